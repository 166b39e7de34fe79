//! The image store against archives made here, in both formats `docker save` writes.

use super::*;
use std::os::unix::fs::PermissionsExt;

/// One member of a layer tar.
enum Item<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32, u64),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    /// A name written into the header as is (the tar crate refuses `..` otherwise).
    RawFile(&'a str),
}

fn header(kind: tar::EntryType, mode: u32, uid: u64, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(uid);
    h.set_size(size);
    h.set_mtime(1_700_000_000);
    h
}

fn layer(items: &[Item<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for item in items {
        match item {
            Item::Dir(path, mode) => {
                let mut h = header(tar::EntryType::Directory, *mode, 0, 0);
                b.append_data(&mut h, path, io::empty()).expect("dir");
            }
            Item::File(path, data, mode, uid) => {
                let mut h = header(tar::EntryType::Regular, *mode, *uid, data.len() as u64);
                b.append_data(&mut h, path, *data).expect("file");
            }
            Item::Symlink(path, target) => {
                let mut h = header(tar::EntryType::Symlink, 0o777, 0, 0);
                b.append_link(&mut h, path, target).expect("symlink");
            }
            Item::Hardlink(path, target) => {
                let mut h = header(tar::EntryType::Link, 0o644, 0, 0);
                b.append_link(&mut h, path, target).expect("hardlink");
            }
            Item::RawFile(path) => {
                let mut h = header(tar::EntryType::Regular, 0o644, 0, 4);
                let name = &mut h.as_old_mut().name;
                name[..path.len()].copy_from_slice(path.as_bytes());
                h.set_cksum();
                b.append(&h, &b"evil"[..]).expect("raw");
            }
        }
    }
    b.into_inner().expect("layer tar")
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn config_json(layers: &[Vec<u8>], user: &str) -> Vec<u8> {
    let diff_ids: Vec<String> = layers
        .iter()
        .map(|l| format!("sha256:{}", sha(l)))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/opt/kernel/venv/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "User": user,
            "WorkingDir": "/home/kernel",
            "Entrypoint": ["/usr/bin/tini", "-g", "--"],
            "Cmd": ["python3", "/opt/kernel/launch.py"],
            "Labels": {"org.kernelgate.build": "offline"}
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    }))
    .expect("config")
}

fn append(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
    let mut h = header(tar::EntryType::Regular, 0o644, 0, data.len() as u64);
    b.append_data(&mut h, path, data).expect("member");
}

/// An archive as `docker save` before Docker 25 writes it.
fn docker_save(layers: &[Vec<u8>], config: &[u8], tags: &[&str]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let config_name = format!("{}.json", sha(config));
    append(&mut b, &config_name, config);
    let mut names = Vec::new();
    for l in layers {
        let name = format!("{}/layer.tar", sha(l));
        append(&mut b, &name, l);
        names.push(name);
    }
    let manifest = serde_json::json!([{"Config": config_name, "RepoTags": tags, "Layers": names}]);
    append(&mut b, "manifest.json", manifest.to_string().as_bytes());
    b.into_inner().expect("archive")
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).expect("gzip");
    e.finish().expect("gzip")
}

/// An OCI image layout tar whose layers are gzip'd, the image listed once per name; with
/// `docker_tags`, also the `manifest.json` Docker 25 and later write beside it.
fn oci_layout(
    layers: &[Vec<u8>],
    config: &[u8],
    names: &[&str],
    docker_tags: Option<&[&str]>,
) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    append(&mut b, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    let mut descriptors = Vec::new();
    let mut blobs = Vec::new();
    for l in layers {
        let gz = gzip(l);
        append(&mut b, &format!("blobs/sha256/{}", sha(&gz)), &gz);
        blobs.push(format!("blobs/sha256/{}", sha(&gz)));
        descriptors.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": format!("sha256:{}", sha(&gz)),
            "size": gz.len(),
        }));
    }
    append(&mut b, &format!("blobs/sha256/{}", sha(config)), config);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{}", sha(config)), "size": config.len()},
        "layers": descriptors,
    })
    .to_string();
    append(
        &mut b,
        &format!("blobs/sha256/{}", sha(manifest.as_bytes())),
        manifest.as_bytes(),
    );
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": names.iter().map(|n| serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{}", sha(manifest.as_bytes())),
            "size": manifest.len(),
            "annotations": {"io.containerd.image.name": n},
        })).collect::<Vec<_>>(),
    });
    append(&mut b, "index.json", index.to_string().as_bytes());
    if let Some(tags) = docker_tags {
        let manifest = serde_json::json!([{
            "Config": format!("blobs/sha256/{}", sha(config)),
            "RepoTags": tags,
            "Layers": blobs,
        }]);
        append(&mut b, "manifest.json", manifest.to_string().as_bytes());
    }
    b.into_inner().expect("archive")
}

/// A base layer and a layer on top with a whiteout, an opaque directory, a file written
/// through a symlink and a hard link.
fn two_layers() -> Vec<Vec<u8>> {
    let base = layer(&[
        Item::Dir("etc/", 0o755),
        Item::File("etc/passwd", b"root:x:0:0\n", 0o644, 0),
        Item::Dir("usr/", 0o755),
        Item::Dir("usr/lib/", 0o755),
        Item::Symlink("lib", "usr/lib"),
        Item::File("usr/bin-setuid", b"#!", 0o4755, 0),
        Item::File("shared", b"everyone writes here", 0o666, 0),
        Item::Dir("opt/", 0o755),
        Item::Dir("opt/kernel/", 0o755),
        Item::File("opt/kernel/launch.py", b"print('hi')\n", 0o644, 1000),
        Item::File("gone.txt", b"deleted above", 0o644, 0),
        Item::Dir("cache/", 0o755),
        Item::File("cache/old-a", b"a", 0o644, 0),
        Item::Dir("cache/sub/", 0o755),
        Item::File("cache/sub/old-b", b"b", 0o644, 0),
    ]);
    let top = layer(&[
        Item::File(".wh.gone.txt", b"", 0o644, 0),
        // Written before the opaque marker of its directory: it must survive it.
        Item::File("cache/new", b"n", 0o644, 0),
        Item::File("cache/.wh..wh..opq", b"", 0o644, 0),
        Item::File("lib/libdemo.so", b"ELF", 0o755, 0),
        Item::Hardlink("etc/passwd-", "etc/passwd"),
        Item::File("opt/kernel/launch.py", b"print('v2')\n", 0o644, 1000),
    ]);
    vec![base, top]
}

struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kernelgate-images-test-{}-{}",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, bytes).expect("write archive");
        path
    }

    fn store(&self) -> ImageStore {
        ImageStore::open(self.0.join("store")).expect("open store")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path)
        .expect("stat")
        .permissions()
        .mode()
        & 0o7777
}

fn check_rootfs(image: &StoredImage) {
    let root = &image.rootfs;
    assert!(!root.join("gone.txt").exists(), "whiteout applied");
    assert!(!root.join("cache/old-a").exists(), "opaque dir emptied");
    assert!(
        !root.join("cache/sub").exists(),
        "opaque dir emptied of subdirs"
    );
    assert_eq!(fs::read(root.join("cache/new")).expect("new"), b"n");
    assert_eq!(
        fs::read_link(root.join("lib")).expect("symlink"),
        Path::new("usr/lib")
    );
    assert_eq!(
        fs::read(root.join("usr/lib/libdemo.so")).expect("through the symlink"),
        b"ELF"
    );
    let a = fs::metadata(root.join("etc/passwd")).expect("passwd");
    let b = fs::metadata(root.join("etc/passwd-")).expect("hard link");
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2));
    assert_eq!(
        fs::read(root.join("opt/kernel/launch.py")).expect("launch.py"),
        b"print('v2')\n"
    );
    assert_eq!(mode(&root.join("usr/bin-setuid")), 0o4755);
    let etc = fs::metadata(root.join("etc"))
        .expect("etc")
        .modified()
        .expect("mtime");
    assert_eq!(
        etc,
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000),
        "directory times as in the layers"
    );
    assert_eq!(mode(&root.join("shared")), 0o644, "no write for others");
    if running_as_root() {
        let launch = fs::metadata(root.join("opt/kernel/launch.py")).expect("launch.py");
        assert_eq!((launch.uid(), launch.gid()), (1000, 1000));
    }
    assert_eq!(image.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(image.config.cmd, ["python3", "/opt/kernel/launch.py"]);
    assert_eq!(image.config.entrypoint, ["/usr/bin/tini", "-g", "--"]);
    assert_eq!(image.config.working_dir.as_deref(), Some("/home/kernel"));
    assert_eq!(image.config.env[1], "LANG=C.UTF-8");
    assert_eq!(image.config.labels["org.kernelgate.build"], "offline");
}

#[test]
fn a_docker_save_archive_is_unpacked_with_whiteouts_links_modes_and_owners() {
    let scratch = Scratch::new();
    let layers = two_layers();
    let config = config_json(&layers, "1000:1000");
    let archive = scratch.write(
        "saved.tar",
        &docker_save(&layers, &config, &["demo:latest", "demo:v1"]),
    );
    let store = scratch.store();
    let imported = store.import(&archive).expect("import");
    assert_eq!(imported.len(), 1);
    let image = &imported[0];
    assert_eq!(image.id, format!("sha256:{}", sha(&config)));
    assert_eq!(image.tags, ["demo:latest", "demo:v1"]);
    assert_eq!(image.rootfs, store.root().join(sha(&config)).join("rootfs"));
    check_rootfs(image);
    assert_eq!(
        fs::read(store.root().join(sha(&config)).join("config.json")).expect("config kept"),
        config
    );
    let leftovers: Vec<_> = fs::read_dir(store.root())
        .expect("store")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(TEMP_PREFIX))
        .collect();
    assert!(leftovers.is_empty(), "temporary directories left behind");
}

#[test]
fn an_oci_layout_with_gzip_layers_is_unpacked_the_same_way() {
    let scratch = Scratch::new();
    let layers = two_layers();
    let config = config_json(&layers, "1000:1000");
    let archive = scratch.write(
        "oci.tar",
        &oci_layout(
            &layers,
            &config,
            &["registry.example/library/demo:v2", "demo"],
            None,
        ),
    );
    let store = scratch.store();
    let imported = store.import(&archive).expect("import");
    assert_eq!(imported.len(), 1, "one image listed under two names");
    assert_eq!(imported[0].tags, ["demo:latest", "demo:v2"]);
    check_rootfs(&imported[0]);
    // The whole archive gzip'd works too.
    let zipped = scratch.write("oci.tar.gz", &gzip(&fs::read(&archive).expect("read")));
    assert_eq!(
        store.import(&zipped).expect("import gz")[0].id,
        imported[0].id
    );
}

#[test]
fn a_layer_docker_save_stored_once_as_a_symlink_is_read_through_it() {
    // `docker save` before Docker 25 writes a layer two images share once and links the
    // second directory's layer.tar to it.
    let scratch = Scratch::new();
    let base = layer(&[Item::File("shared-file", b"s", 0o644, 0)]);
    let config = config_json(std::slice::from_ref(&base), "");
    let mut b = tar::Builder::new(Vec::new());
    append(&mut b, &format!("{}.json", sha(&config)), &config);
    append(&mut b, "real/layer.tar", &base);
    let mut h = header(tar::EntryType::Symlink, 0o777, 0, 0);
    b.append_link(&mut h, "linked/layer.tar", "../real/layer.tar")
        .expect("link");
    let manifest = serde_json::json!([{
        "Config": format!("{}.json", sha(&config)),
        "RepoTags": ["linked:1"],
        "Layers": ["linked/layer.tar"],
    }]);
    append(&mut b, "manifest.json", manifest.to_string().as_bytes());
    let archive = scratch.write("linked.tar", &b.into_inner().expect("archive"));
    let image = scratch.store().import(&archive).expect("import").remove(0);
    assert!(image.rootfs.join("shared-file").is_file());
}

#[test]
fn an_archive_in_both_formats_is_read_by_its_docker_manifest() {
    let scratch = Scratch::new();
    let layers = two_layers();
    let config = config_json(&layers, "1000:1000");
    let archive = scratch.write(
        "both.tar",
        &oci_layout(
            &layers,
            &config,
            &["registry.example/library/demo:v3"],
            Some(&["demo:v3", "demo:latest"]),
        ),
    );
    let image = scratch.store().import(&archive).expect("import").remove(0);
    assert_eq!(image.tags, ["demo:latest", "demo:v3"]);
    check_rootfs(&image);
}

#[test]
fn importing_an_image_again_only_adds_its_tags() {
    let scratch = Scratch::new();
    let layers = two_layers();
    let config = config_json(&layers, "1000:1000");
    let store = scratch.store();
    let first = scratch.write("a.tar", &docker_save(&layers, &config, &["demo:v1"]));
    let image = store.import(&first).expect("first import").remove(0);
    // A mark in the unpacked tree shows whether it is unpacked again.
    let mark = image.rootfs.join("mark");
    fs::write(&mark, b"still here").expect("mark");
    let second = scratch.write("b.tar", &docker_save(&layers, &config, &["demo:v2"]));
    let again = store.import(&second).expect("second import").remove(0);
    assert_eq!(again.id, image.id);
    assert_eq!(again.tags, ["demo:v1", "demo:v2"]);
    assert!(
        mark.exists(),
        "the stored root filesystem was unpacked again"
    );
    assert_eq!(store.list().expect("list").len(), 1);
}

#[test]
fn concurrent_imports_into_one_store_keep_every_tag() {
    let scratch = Scratch::new();
    let layers = two_layers();
    let config = config_json(&layers, "1000:1000");
    let tags: Vec<String> = (0..8).map(|n| format!("demo:t{n}")).collect();
    let archives: Vec<PathBuf> = tags
        .iter()
        .enumerate()
        .map(|(n, tag)| scratch.write(&format!("{n}.tar"), &docker_save(&layers, &config, &[tag])))
        .collect();
    std::thread::scope(|threads| {
        for archive in &archives {
            // Each its own opening of the store, as separate `kernelgate image import`s are.
            let store = scratch.store();
            threads.spawn(move || store.import(archive).expect("import"));
        }
    });
    let stored = scratch.store().list().expect("list");
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].tags, tags);
}

#[test]
fn images_are_found_by_tag_name_id_and_id_prefix() {
    let scratch = Scratch::new();
    let store = scratch.store();
    let layers = two_layers();
    let config = config_json(&layers, "1000:1000");
    let archive = scratch.write("a.tar", &docker_save(&layers, &config, &["demo:latest"]));
    let id = store.import(&archive).expect("import").remove(0).id;
    let other_layers = vec![layer(&[Item::File("only", b"x", 0o644, 0)])];
    let other_config = config_json(&other_layers, "");
    let other = scratch.write(
        "b.tar",
        &docker_save(&other_layers, &other_config, &["other:1"]),
    );
    store.import(&other).expect("import other");

    assert_eq!(store.find("demo:latest").expect("by tag").id, id);
    assert_eq!(store.find("demo").expect("by name").id, id);
    assert_eq!(store.find(&id).expect("by id").id, id);
    assert_eq!(store.find(&id[7..19]).expect("by prefix").id, id);
    assert_eq!(store.find("other:1").expect("other").config.user, None);

    let err = store.find("missing:2").expect_err("not stored").to_string();
    assert!(err.contains("\"missing:2\""), "{err}");
    assert!(err.contains("demo:latest, other:1"), "{err}");
    assert!(err.contains("kernelgate image import FILE"), "{err}");
    assert!(err.contains("make image-archive"), "{err}");

    let empty = ImageStore::open(scratch.0.join("empty")).expect("open");
    let err = empty.find("demo").expect_err("empty").to_string();
    assert!(err.contains("the store is empty"), "{err}");
}

#[test]
fn paths_leaving_the_root_are_refused_and_nothing_is_kept() {
    let cases = [
        ("dotdot", layer(&[Item::RawFile("a/../../escaped")]), "'..'"),
        ("absolute", layer(&[Item::RawFile("/escaped")]), "absolute"),
        (
            "symlink",
            layer(&[
                Item::Symlink("up", "../../../../.."),
                Item::File("up/escaped", b"x", 0o644, 0),
            ]),
            "outside the image's root",
        ),
    ];
    for (what, bad, reason) in cases {
        let scratch = Scratch::new();
        let store = scratch.store();
        let layers = vec![bad];
        let config = config_json(&layers, "");
        let archive = scratch.write("bad.tar", &docker_save(&layers, &config, &["bad:1"]));
        let err = store.import(&archive).expect_err(what);
        assert!(
            matches!(err, ImageError::UnsafePath { .. }),
            "{what}: {err}"
        );
        let message = err.to_string();
        assert!(message.contains("refusing to import"), "{message}");
        assert!(message.contains(reason), "{what}: {message}");
        assert!(!scratch.0.join("escaped").exists(), "{what}: escaped");
        assert!(!Path::new("/escaped").exists(), "{what}: escaped to /");
        let left: Vec<_> = fs::read_dir(store.root())
            .expect("store")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{what}: left {left:?}");
    }
}

#[test]
fn a_directory_replaced_by_a_symlink_leaves_the_host_alone() {
    let scratch = Scratch::new();
    let outside = scratch.0.join("outside");
    fs::create_dir_all(outside.join("sub")).expect("outside");
    let before = fs::metadata(outside.join("sub"))
        .expect("stat")
        .modified()
        .expect("mtime");
    let target = format!("../../../../../../../../../..{}", outside.display());
    let layers = vec![
        layer(&[Item::Dir("d/", 0o755), Item::Dir("d/sub/", 0o755)]),
        layer(&[
            Item::File(".wh.d", b"", 0o644, 0),
            Item::Symlink("d", &target),
        ]),
    ];
    let config = config_json(&layers, "");
    let archive = scratch.write("a.tar", &docker_save(&layers, &config, &["swap:1"]));
    let image = scratch.store().import(&archive).expect("import").remove(0);
    assert!(fs::symlink_metadata(image.rootfs.join("d"))
        .expect("d")
        .file_type()
        .is_symlink());
    let after = fs::metadata(outside.join("sub"))
        .expect("stat")
        .modified()
        .expect("mtime");
    assert_eq!(before, after, "a time was set through the symlink");
}

#[test]
fn opening_the_store_removes_imports_whose_process_is_gone() {
    let scratch = Scratch::new();
    let root = scratch.0.join("store");
    // Beyond the kernel's largest pid: no such process.
    let abandoned = root.join(format!("{TEMP_PREFIX}image-99999999-0"));
    let ours = root.join(format!("{TEMP_PREFIX}image-{}-0", std::process::id()));
    fs::create_dir_all(abandoned.join("rootfs/etc")).expect("abandoned");
    fs::create_dir_all(&ours).expect("ours");
    let _store = ImageStore::open(root).expect("open");
    assert!(!abandoned.exists(), "the abandoned import stayed");
    assert!(ours.exists(), "a running import was removed");
}

#[test]
fn an_absolute_symlink_means_the_images_own_root() {
    let scratch = Scratch::new();
    let store = scratch.store();
    let layers = vec![layer(&[
        Item::Dir("etc/", 0o755),
        Item::Symlink("conf", "/etc"),
        Item::File("conf/app.conf", b"x", 0o644, 0),
    ])];
    let config = config_json(&layers, "");
    let archive = scratch.write("a.tar", &docker_save(&layers, &config, &["abs:1"]));
    let image = store.import(&archive).expect("import").remove(0);
    assert!(image.rootfs.join("etc/app.conf").is_file());
}

#[test]
fn a_damaged_or_foreign_archive_is_refused_with_the_reason() {
    let scratch = Scratch::new();
    let store = scratch.store();
    let not_tar = scratch.write("notes.txt", b"hello");
    let err = store.import(&not_tar).expect_err("not a tar").to_string();
    assert!(err.contains("is not an image archive"), "{err}");

    let plain = {
        let mut b = tar::Builder::new(Vec::new());
        append(&mut b, "README", b"just a tar");
        scratch.write("plain.tar", &b.into_inner().expect("tar"))
    };
    let err = store.import(&plain).expect_err("no manifest").to_string();
    assert!(err.contains("neither manifest.json"), "{err}");

    // A layer that is not the one the config's diff_ids name.
    let named = vec![layer(&[Item::File("a", b"a", 0o644, 0)])];
    let shipped = vec![layer(&[Item::File("b", b"b", 0o644, 0)])];
    let config = config_json(&named, "");
    let swapped = scratch.write("swapped.tar", &docker_save(&shipped, &config, &["x:1"]));
    let err = store.import(&swapped).expect_err("digest").to_string();
    assert!(err.contains("does not match its digest"), "{err}");
    assert!(store.list().expect("list").is_empty());
}
