use super::lifecycle::parse_counter;
use super::*;
use std::path::Path;

#[test]
fn the_engine_refuses_to_run_unprivileged_and_says_why() {
    assert!(refuse_unprivileged(0).is_ok());
    let why = refuse_unprivileged(1000).expect_err("refused");
    assert!(why.contains("needs root"), "{why}");
    assert!(
        why.contains("namespaces") && why.contains("cgroups"),
        "{why}"
    );
    assert!(why.contains("--engine docker"), "{why}");
}

#[test]
fn out_of_memory_kills_are_read_from_the_cgroup() {
    let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";
    assert_eq!(parse_counter(v1, "oom_kill"), Some(2));
    let v2 = "low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\noom_group_kill 0\n";
    assert_eq!(parse_counter(v2, "oom_kill"), Some(1));
    assert_eq!(parse_counter("", "oom_kill"), None);
}

#[test]
fn a_missing_runsc_names_the_fix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let settings = GvisorSettings {
        runsc: dir.path().join("no-runsc"),
        image: "img".to_owned(),
        runtime_dir: dir.path().to_owned(),
        memory_mb: 512,
        cpus: 1.0,
        pids: 256,
        disk_mb: 256,
        packages: None,
    };
    let resolve: ImageResolver = Arc::new(|_| Err(BackendError::Runtime("none".to_owned())));
    let err = GvisorEngine::new(settings, resolve).expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("make gvisor") && text.contains("--runsc PATH"),
        "{text}"
    );
}

/// An image store under `dir` holding `image`, brought in from Docker with `docker save`
/// and imported unless the store already has that image id (tests only: the engine never
/// touches Docker).
pub(crate) fn store_from_docker(dir: &Path, image: &str) -> crate::images::ImageStore {
    use std::process::Command;
    let store = crate::images::ImageStore::open(dir.to_owned()).expect("image store");
    let inspect = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .output()
        .expect("docker image inspect");
    assert!(inspect.status.success(), "the image {image} is in Docker");
    let id = String::from_utf8(inspect.stdout).expect("utf-8");
    if store.find(image).is_ok_and(|stored| stored.id == id.trim()) {
        return store;
    }
    let archive = tempfile::NamedTempFile::new_in("/var/tmp").expect("archive file");
    let saved = Command::new("docker")
        .args(["save", "-o"])
        .arg(archive.path())
        .arg(image)
        .status()
        .expect("docker save");
    assert!(saved.success(), "docker save {image}");
    store.import(archive.path()).expect("import");
    store
}
