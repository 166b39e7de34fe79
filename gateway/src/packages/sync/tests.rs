use super::image::*;
use super::pip::*;
use super::progress::{size, summarize};
use super::wheels::*;
use super::*;
use crate::packages::lock::PythonTarget;
use std::io::Cursor;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use zip::write::SimpleFileOptions;

/// A zip of `(name, contents, unix mode)` entries.
fn zip_of(entries: &[(&str, &str, u32)]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    for (name, text, mode) in entries {
        let options = SimpleFileOptions::default().unix_permissions(*mode);
        if name.ends_with('/') {
            zip.add_directory(*name, options).expect("works");
        } else {
            zip.start_file(*name, options).expect("works");
            zip.write_all(text.as_bytes()).expect("works");
        }
    }
    zip.finish().expect("works").into_inner()
}

fn plan_of(bytes: Vec<u8>) -> Result<Vec<String>, String> {
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).expect("works");
    plan_unpack(&mut archive).map(|plan| plan.into_iter().map(|(_, path, ..)| path).collect())
}

fn image() -> BTreeMap<String, (String, String)> {
    BTreeMap::from([
        ("numpy".to_owned(), ("numpy".to_owned(), "2.4.6".to_owned())),
        (
            "pygments".to_owned(),
            ("Pygments".to_owned(), "2.21.0".to_owned()),
        ),
    ])
}

/// As pip 23.2 wrote it for `kgfix-app` from a --find-links directory.
const REPORT: &str = r#"{
  "version": "1", "pip_version": "23.2.1",
  "install": [
    {"download_info": {"url": "file:///tmp/kgfix/links/kgfix_app-1.0-py3-none-any.whl",
       "archive_info": {"hash": "sha256=BE1E2E2AF673117E14E484DBF5465D2A687E7DC9396C77E840BA1952CFA6AC84",
         "hashes": {"sha256": "BE1E2E2AF673117E14E484DBF5465D2A687E7DC9396C77E840BA1952CFA6AC84"}}},
     "is_direct": false, "requested": true,
     "metadata": {"metadata_version": "2.1", "name": "KGFix_App", "version": "1.0",
       "summary": "App fixture", "requires_dist": ["kgfix-dep>=0.1"]}},
    {"download_info": {"url": "https://files.example/packages/ab/kgfix_dep-0.1%2Bl-py3-none-any.whl#sha256=32",
       "archive_info": {"hash": "sha256=3293e56236d82fcabd6598526486fb8ee5a18e37d4267580e1c38c355b503ea0"}},
     "is_direct": false, "requested": false,
     "metadata": {"metadata_version": "2.1", "name": "kgfix-dep", "version": "0.1+l", "summary": ""}}
  ],
  "environment": {"python_version": "3.11"}
}"#;

#[test]
fn a_pip_report_gives_names_versions_urls_hashes_and_summaries() {
    let items = parse_report(REPORT).expect("works");
    assert_eq!(items.len(), 2);
    assert_eq!(
        items[0],
        Resolved {
            name: "KGFix_App".to_owned(),
            key: "kgfix-app".to_owned(),
            version: "1.0".to_owned(),
            url: "file:///tmp/kgfix/links/kgfix_app-1.0-py3-none-any.whl".to_owned(),
            sha256: Some(
                "be1e2e2af673117e14e484dbf5465d2a687e7dc9396c77e840ba1952cfa6ac84".to_owned()
            ),
            summary: Some("App fixture".to_owned()),
            requested: true,
        }
    );
    // An older report has only `hash`; an empty summary is none.
    assert_eq!(
        items[1].sha256.as_deref(),
        Some("3293e56236d82fcabd6598526486fb8ee5a18e37d4267580e1c38c355b503ea0")
    );
    assert_eq!(items[1].summary, None);
    assert!(!items[1].requested);
    assert!(parse_report(r#"{"version": "2", "install": []}"#).is_err());
}

#[test]
fn wheel_names_and_local_paths_come_from_urls() {
    assert_eq!(
        wheel_file_name(
            "https://files.example/packages/ab/kgfix_dep-0.1%2Bl-py3-none-any.whl#sha256=32"
        )
        .as_deref(),
        Some("kgfix_dep-0.1+l-py3-none-any.whl")
    );
    assert_eq!(wheel_file_name("https://files.example/x-1.0.tar.gz"), None);
    assert_eq!(wheel_file_name("https://files.example/a%2Fb.whl"), None);
    assert_eq!(
        file_url_path("file:///tmp/my%20links/a-1-py3-none-any.whl"),
        Some(PathBuf::from("/tmp/my links/a-1-py3-none-any.whl"))
    );
    assert_eq!(
        file_url_path("file://localhost/w/a.whl"),
        Some(PathBuf::from("/w/a.whl"))
    );
    assert_eq!(file_url_path("https://files.example/a.whl"), None);
}

#[test]
fn a_conflict_with_the_image_says_what_the_image_has() {
    let stdout = "Looking in links: links\nProcessing ./links/kgfix_needs_numpy1-1.0-py3-none-any.whl\n\nThe conflict is caused by:\n    kgfix-needs-numpy1 1.0 depends on numpy<2\n    The user requested (constraint) numpy==2.4.6\n\nTo fix this you could try to:\n1. loosen the range\n";
    let stderr = "ERROR: Cannot install kgfix-needs-numpy1==1.0 because these package versions have conflicting dependencies.\nERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts\n";
    assert_eq!(
        resolution_failure(stdout, stderr, &image()).expect("works"),
        "conflicting dependencies: kgfix-needs-numpy1 1.0 depends on numpy<2; the image has numpy 2.4.6"
    );
    let stdout = "The conflict is caused by:\n    b 1.0 depends on a==2\n    The user requested (constraint) a==1.0\n";
    assert_eq!(
        resolution_failure(stdout, stderr, &image()).expect("works"),
        "conflicting dependencies: b 1.0 depends on a==2; a 1.0 is locked for an earlier allowlist entry"
    );
    // Without the causes (pip --quiet), the first error line.
    assert_eq!(
        resolution_failure("", stderr, &image()).expect("works"),
        "Cannot install kgfix-needs-numpy1==1.0 because these package versions have conflicting dependencies."
    );
}

#[test]
fn a_missing_package_says_that_none_was_found() {
    let stderr = "ERROR: Ignored the following versions that require a different python version: 2.0 Requires-Python >=3.12\nERROR: Could not find a version that satisfies the requirement nonexistent (from versions: none)\nERROR: No matching distribution found for nonexistent\n";
    assert_eq!(
        resolution_failure("Looking in links: x\n", stderr, &image()).expect("works"),
        "Could not find a version that satisfies the requirement nonexistent (from versions: none)"
    );
    assert_eq!(
        resolution_failure("", "Traceback\n  boom  \n\n", &image()).expect("works"),
        "boom"
    );
    assert_eq!(resolution_failure("", "", &image()), None);
    let long = format!("ERROR: {}\n", "x ".repeat(1000));
    assert!(
        resolution_failure("", &long, &image())
            .expect("works")
            .len()
            <= MAX_REASON + 3
    );
}

#[test]
fn constraints_pin_every_name_once_and_sorted() {
    let pinned = BTreeMap::from([
        ("pygments", "2.21.0"),
        ("kgfix-dep", "0.1"),
        ("numpy", "2.4.6"),
    ]);
    let text = constraints(&pinned);
    let lines: Vec<_> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        lines,
        ["kgfix-dep==0.1", "numpy==2.4.6", "pygments==2.21.0"]
    );
}

#[test]
fn only_pinnable_image_versions_are_pinned() {
    let facts = ImagePython {
        version: "3.11.2".to_owned(),
        implementation: "cp".to_owned(),
        abi: "cp311".to_owned(),
        platforms: vec!["linux_x86_64".to_owned()],
        installed: vec![
            ("Pygments".to_owned(), "2.21.0".to_owned()),
            ("torch".to_owned(), "2.5.0+cpu".to_owned()),
            ("odd".to_owned(), "1.0-beta 2".to_owned()),
            ("-bad".to_owned(), "1".to_owned()),
        ],
    };
    let pins = facts.pins();
    assert_eq!(pins.keys().collect::<Vec<_>>(), ["pygments", "torch"]);
    assert_eq!(
        pins["pygments"],
        ("Pygments".to_owned(), "2.21.0".to_owned())
    );
}

#[test]
fn pip_targets_the_images_interpreter() {
    let target = PythonTarget {
        version: "3.11.2".to_owned(),
        implementation: "cp".to_owned(),
        abi: "cp311".to_owned(),
        platforms: vec![
            "manylinux_2_36_x86_64".to_owned(),
            "linux_x86_64".to_owned(),
        ],
    };
    assert_eq!(
        target_args(&target).join(" "),
        "--python-version 3.11.2 --implementation cp --abi cp311 --abi abi3 --abi none --platform manylinux_2_36_x86_64 --platform linux_x86_64"
    );
    let odd = PythonTarget {
        version: "3.13.0rc1".to_owned(),
        ..target
    };
    assert_eq!(target_args(&odd)[1], "3.13.0");
    let links = source_args(
        &[PathBuf::from("/srv/links")],
        Path::new("/w/.sync-1/in-image"),
    );
    assert_eq!(
        links.join(" "),
        "--isolated --no-index --find-links /srv/links --find-links /w/.sync-1/in-image"
    );
    assert_eq!(
        source_args(&[], Path::new("/s")).join(" "),
        "--find-links /s"
    );
}

#[test]
fn the_interpreter_is_the_one_the_image_runs() {
    let strings = |s: &[&str]| s.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        image_interpreter(
            &strings(&["/usr/bin/tini", "-g", "--"]),
            &strings(&["/opt/kernel/venv/bin/python", "/opt/kernel/launch.py"])
        ),
        "/opt/kernel/venv/bin/python"
    );
    assert_eq!(
        image_interpreter(&[], &strings(&["python3.12", "-m", "x"])),
        "python3.12"
    );
    assert_eq!(
        image_interpreter(&[], &strings(&["/usr/bin/python-config"])),
        "python3"
    );
    assert_eq!(
        image_interpreter(&[], &strings(&["jupyter", "kernel"])),
        "python3"
    );
}

#[test]
fn pip_versions_are_read_from_its_banner() {
    assert_eq!(
        pip_version("pip 23.2.1 from /x/pip (python 3.11)\n"),
        Some((23, 2))
    );
    assert_eq!(pip_version("pip 24.0 from /x"), Some((24, 0)));
    assert_eq!(pip_version("pip 25.1b1 from /x"), Some((25, 1)));
    assert!(pip_version("pip 21.3.1 from /x").expect("works") < MIN_PIP);
    assert_eq!(pip_version("Python 3.11"), None);
}

#[test]
fn entries_go_to_the_root_and_data_schemes_as_site_packages_would() {
    assert_eq!(
        install_path("pkg/__init__.py").expect("works").as_deref(),
        Some("pkg/__init__.py")
    );
    assert_eq!(
        install_path("./pkg//m.py").expect("works").as_deref(),
        Some("pkg/m.py")
    );
    assert_eq!(
        install_path("pkg-1.0.data/purelib/extra/m.py")
            .expect("works")
            .as_deref(),
        Some("extra/m.py")
    );
    assert_eq!(
        install_path("pkg-1.0.data/platlib/_c.so")
            .expect("works")
            .as_deref(),
        Some("_c.so")
    );
    for dropped in [
        "pkg-1.0.data/scripts/run",
        "pkg-1.0.data/headers/a.h",
        "pkg-1.0.data/data/share/x",
        "pkg-1.0.data/purelib/",
    ] {
        assert_eq!(install_path(dropped).expect("works"), None, "{dropped}");
    }
    for unsafe_path in ["/etc/passwd", "pkg/../../x", "..", "pkg\\..\\x", "a\0b"] {
        let err = install_path(unsafe_path).expect_err("fails");
        assert!(err.contains("unsafe path"), "{unsafe_path}: {err}");
    }
}

#[test]
fn pth_files_that_site_would_run_are_refused() {
    let err = plan_of(zip_of(&[
        ("m.py", "", 0o644),
        ("evil.pth", "import os", 0o644),
    ]))
    .expect_err("fails");
    assert!(err.contains(".pth") && err.contains("evil.pth"), "{err}");
    let err =
        plan_of(zip_of(&[("p-1.data/platlib/Evil.PTH", "import os", 0o644)])).expect_err("fails");
    assert!(err.contains("p-1.data/platlib/Evil.PTH"), "{err}");
    // Deeper in a package, or under a scheme that is dropped, site never reads it.
    let plan = plan_of(zip_of(&[
        ("pkg/data.pth", "", 0o644),
        ("p-1.data/data/x.pth", "", 0o644),
    ]))
    .expect("works");
    assert_eq!(plan, ["pkg/data.pth"]);
}

#[test]
fn unsafe_and_duplicate_entries_are_refused() {
    let err = plan_of(zip_of(&[("../outside.py", "", 0o644)])).expect_err("fails");
    assert!(err.contains("unsafe path"), "{err}");
    let err = plan_of(zip_of(&[
        ("m.py", "a", 0o644),
        ("p-1.data/purelib/m.py", "b", 0o644),
    ]))
    .expect_err("fails");
    assert!(err.contains("two entries for m.py"), "{err}");
}

#[test]
fn a_wheel_unpacks_once_with_site_packages_layout_and_modes() {
    let dir = tempfile::tempdir().expect("works");
    let wheel = dir.path().join("p-1.0-py3-none-any.whl");
    std::fs::write(
        &wheel,
        zip_of(&[
            ("p/", "", 0o755),
            ("p/__init__.py", "X = 1\n", 0o664),
            ("p/tool", "#!/bin/sh\n", 0o775),
            ("p-1.0.data/purelib/p_extra.py", "Y = 2\n", 0o644),
            ("p-1.0.data/scripts/p-run", "#!python\n", 0o755),
            ("p-1.0.dist-info/METADATA", "Name: p\nVersion: 1.0\n", 0o644),
        ]),
    )
    .expect("works");
    let sha = sha256_of(&wheel).expect("works");
    let dest = dir.path().join("image").join("p-1.0");
    std::fs::create_dir(dir.path().join("image")).expect("works");
    assert_eq!(install_wheel(&wheel, &sha, &dest), Ok(true));
    let mode = |p: &str| {
        std::fs::metadata(dest.join(p))
            .expect("works")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(
        std::fs::read_to_string(dest.join("p/__init__.py")).expect("works"),
        "X = 1\n"
    );
    assert_eq!(
        std::fs::read_to_string(dest.join("p_extra.py")).expect("works"),
        "Y = 2\n"
    );
    assert!(dest.join("p-1.0.dist-info/METADATA").is_file());
    assert!(!dest.join("p-1.0.data").exists() && !dest.join("p-run").exists());
    assert_eq!(
        (mode(""), mode("p"), mode("p/__init__.py"), mode("p/tool")),
        (0o755, 0o755, 0o644, 0o755)
    );
    // Present: left as it is; nothing temporary left beside it.
    assert_eq!(install_wheel(&wheel, &sha, &dest), Ok(false));
    let names: Vec<_> = std::fs::read_dir(dir.path().join("image"))
        .expect("works")
        .map(|e| e.expect("works").file_name())
        .collect();
    assert_eq!(names, ["p-1.0"]);
    // A wheel that is not the one resolved is never unpacked.
    let other = dir.path().join("image").join("p-1.0-again");
    let err = install_wheel(&wheel, &"0".repeat(64), &other).expect_err("fails");
    assert!(err.contains("expected 0000"), "{err}");
    assert!(!other.exists());
}

#[test]
fn a_tree_names_its_wheel_and_other_bytes_of_its_version_are_refused() {
    let dir = tempfile::tempdir().expect("works");
    let wheel = dir.path().join("p-1.0-py3-none-any.whl");
    std::fs::write(&wheel, zip_of(&[("p.py", "X = 1\n", 0o644)])).expect("works");
    let sha = sha256_of(&wheel).expect("works");
    let dest = dir.path().join("p-1.0");
    let none = HashMap::new();
    assert_eq!(
        same_bytes_as_unpacked(&dest, &"1".repeat(64), &none),
        Ok(())
    );
    assert_eq!(install_wheel(&wheel, &sha, &dest), Ok(true));
    assert_eq!(
        std::fs::read_to_string(dest.join(UNPACKED_FROM)).expect("works"),
        format!("{sha}\n")
    );
    assert_eq!(same_bytes_as_unpacked(&dest, &sha, &none), Ok(()));
    let err = same_bytes_as_unpacked(&dest, &"1".repeat(64), &none).expect_err("fails");
    assert!(
        err.contains(&sha) && err.contains("1111") && err.contains("delete"),
        "{err}"
    );
    // A tree unpacked before trees named their wheel: the last lock speaks for it.
    std::fs::remove_file(dest.join(UNPACKED_FROM)).expect("works");
    assert_eq!(
        same_bytes_as_unpacked(&dest, &"1".repeat(64), &none),
        Ok(())
    );
    let previous = HashMap::from([("p-1.0".to_owned(), sha.clone())]);
    assert!(same_bytes_as_unpacked(&dest, &"1".repeat(64), &previous).is_err());
    assert_eq!(same_bytes_as_unpacked(&dest, &sha, &previous), Ok(()));
}

#[test]
fn stand_in_wheels_carry_only_the_images_name_and_version() {
    let dir = tempfile::tempdir().expect("works");
    write_stub_wheel(dir.path(), "Pygments", "2.21.0").expect("works");
    let path = dir.path().join("pygments-2.21.0-py3-none-any.whl");
    let mut archive =
        zip::ZipArchive::new(std::fs::File::open(&path).expect("works")).expect("works");
    let mut metadata = String::new();
    archive
        .by_name("pygments-2.21.0.dist-info/METADATA")
        .expect("works")
        .read_to_string(&mut metadata)
        .expect("works");
    assert!(
        metadata.contains("Name: Pygments\nVersion: 2.21.0\n"),
        "{metadata}"
    );
    assert_eq!(archive.len(), 3);
}

#[test]
fn a_conflict_with_the_entry_itself_names_the_entry() {
    let stdout = "The conflict is caused by:\n    The user requested numpy<2\n    The user requested (constraint) numpy==2.4.6\n\n";
    assert_eq!(
        resolution_failure(stdout, "", &image()).expect("works"),
        "conflicting dependencies: the allowlist entry asks for numpy<2; the image has numpy 2.4.6"
    );
}

#[test]
fn sizes_are_said_in_kib_or_mib() {
    assert_eq!(size(0), "0 KiB");
    assert_eq!(size(5220), "6 KiB");
    assert_eq!(size(1_153_129), "1.1 MiB");
}

#[test]
fn summaries_say_how_many_more() {
    assert_eq!(summarize(&["a", "b", "c"], 2), "a, b and 1 more");
    assert_eq!(summarize(&["a"], 2), "a");
}

/// What `packages sync` runs in the image is locked down like a kernel: no
/// capabilities, read-only root, no network, the kernels' runtime, and the image's
/// launcher first, which installs the kernels' syscall filter before it runs the
/// command.
#[test]
fn the_syncs_containers_get_the_kernels_hardening() {
    use crate::backend::docker::{one_shot_body, Runtime, LAUNCHER_EXEC};
    let python = "/opt/kernel/venv/bin/python";
    let launcher: Vec<String> = [python, "/opt/kernel/launch.py", "/run/kernel/kernel.json"]
        .map(str::to_owned)
        .to_vec();
    let probe = probe_request("sha256:abc", python);
    let compile = compile_request(
        "sha256:abc",
        python,
        Path::new("/srv/wheelhouse/abc"),
        (0, 0),
        &["pkg".to_owned()],
    );
    for (runtime, engine_name) in [
        (Runtime::Runc, "runc"),
        (Runtime::Runsc, "kernelgate-runsc"),
        (Runtime::RunscPtrace, "kernelgate-runsc-ptrace"),
    ] {
        for request in [&probe, &compile] {
            let body = one_shot_body(request, runtime, &launcher).expect("a body");
            let host = body.host_config.clone().expect("host config");
            assert_eq!(
                host.runtime.as_deref(),
                Some(engine_name),
                "the kernels' runtime"
            );
            assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
            assert_eq!(host.cap_add, None);
            assert_eq!(host.privileged, None);
            assert_eq!(host.readonly_rootfs, Some(true));
            assert_eq!(host.network_mode.as_deref(), Some("none"));
            assert_eq!(
                host.security_opt,
                Some(vec!["no-new-privileges".to_owned()]),
                "Docker's default seccomp profile stays, no privileges can be gained"
            );
            assert_eq!(host.memory, Some(512 << 20));
            assert_eq!(host.memory_swap, host.memory);
            assert_eq!(host.pids_limit, Some(64));
            let ulimits = host.ulimits.expect("ulimits");
            assert!(
                ulimits
                    .iter()
                    .any(|u| u.name.as_deref() == Some("core") && u.hard == Some(0)),
                "no core files"
            );
            // The filter: the image's entrypoint (tini) starts its launcher, which
            // installs the filter and then runs the command.
            assert_eq!(body.entrypoint, None, "the image's entrypoint stays");
            let cmd = body.cmd.expect("a command");
            assert_eq!(cmd[..3], launcher[..]);
            assert_eq!(cmd[3], LAUNCHER_EXEC);
            assert_eq!(cmd[4..], request.argv[..]);
            assert_eq!(body.working_dir.as_deref(), Some("/"));
            assert_eq!(body.image.as_deref(), Some("sha256:abc"));
        }
        let probe_body = one_shot_body(&probe, runtime, &launcher).expect("a body");
        assert_eq!(
            probe_body.user.as_deref(),
            Some("1000:1000"),
            "the kernel's user"
        );
        assert_eq!(probe_body.host_config.expect("host").binds, None);
        // The compile step writes as the wheelhouse's owner, only there.
        let compile_body = one_shot_body(&compile, runtime, &launcher).expect("a body");
        assert_eq!(compile_body.user.as_deref(), Some("0:0"));
        assert_eq!(
            compile_body.host_config.expect("host").binds,
            Some(vec!["/srv/wheelhouse/abc:/wheelhouse:rw".to_owned()])
        );
    }
}

/// The sync asks the backend, never an engine of its own: against the fake engine it
/// makes the same two runs, and reports the probe's failure with what it printed.
#[tokio::test]
async fn the_sync_runs_through_the_backend() {
    let fake = crate::backend::fake::FakeBackend::new();
    let err = probe_python(fake.as_ref(), "sha256:abc", "python3")
        .await
        .expect_err("the fake prints no facts");
    assert!(format!("{err:#}").contains("printed no facts"), "{err:#}");
    assert_eq!(fake.runs(), vec![probe_request("sha256:abc", "python3")]);
}

#[test]
fn progress_events_read_as_the_lines_the_cli_prints() {
    let target = PythonTarget {
        version: "3.11".into(),
        implementation: "cp".into(),
        abi: "cp311".into(),
        platforms: vec!["manylinux_2_36_x86_64".into(), "linux_x86_64".into()],
    };
    let lines = [
        Progress::Image {
            image: "kernelgate-kernel:1",
            key: "168db0d22789",
            interpreter: "/usr/bin/python3",
            target: &target,
        }
        .to_string(),
        Progress::Locked {
            requirement: "seaborn",
            brings: vec!["seaborn 0.13.2".into()],
        }
        .to_string(),
        Progress::Locked {
            requirement: "numpy",
            brings: Vec::new(),
        }
        .to_string(),
        Progress::Fetched {
            wheels: 1,
            bytes: 5220,
            reused: 0,
            in_image: vec!["numpy", "pandas"],
        }
        .to_string(),
    ];
    assert_eq!(
        lines,
        [
            "Image kernelgate-kernel:1 (168db0d22789): Python 3.11 (/usr/bin/python3, \
             cp-cp311, platforms manylinux_2_36_x86_64, linux_x86_64)",
            "Locked seaborn: seaborn 0.13.2",
            "Locked numpy: already in the image",
            "Fetched 1 wheel (6 KiB), reused 0, skipped 2 already in the image: numpy, pandas",
        ]
    );
}
