//! `kernelgate packages add|remove|list|sync`.

use super::{allowlist, lock, sync};
use crate::backend::docker::{DockerBackend, DockerSettings};
use crate::backend::gvisor::{GvisorEngine, GvisorSettings, ImageResolver};
use crate::backend::KernelBackend;
use crate::config::{EngineChoice, PackagesAction, PackagesArgs, RuntimeChoice};
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The engine the command's one-shot runs and image lookups go to.
struct Engine {
    choice: EngineChoice,
    image_store: PathBuf,
    runsc: Option<PathBuf>,
}

pub async fn run(args: PackagesArgs) -> anyhow::Result<()> {
    let file = args.file().map_err(anyhow::Error::msg)?;
    let engine = Engine {
        choice: args.engine,
        image_store: args.image_store.clone(),
        runsc: args.runsc.clone(),
    };
    match args.action {
        PackagesAction::Add { requirements } => add(&file, &requirements),
        PackagesAction::Remove { names } => remove(&file, &names),
        PackagesAction::List { wheelhouse, image } => {
            list(&file, wheelhouse.as_deref(), &image, &engine).await
        }
        PackagesAction::Sync {
            wheelhouse,
            find_links,
            image,
            python,
            runtime,
        } => {
            let entries = allowlist::read(&file).map_err(anyhow::Error::msg)?;
            if entries.is_empty() {
                bail!("{} allows no package: add some with `kernelgate packages add NAME --packages {}`", file.display(), file.display());
            }
            let (backend, scratch) = backend(&engine, &image, runtime).await?;
            let opts = sync::SyncOptions {
                entries,
                wheelhouse,
                find_links,
                image,
                python,
            };
            let report = sync::sync(backend.as_ref(), &opts, &mut |step| eprintln!("{step}")).await;
            drop(backend);
            scratch.remove();
            let report = report?;
            println!(
                "synced {} of {} allowed packages for {}; lock: {}",
                report.synced.len(),
                opts.entries.len(),
                opts.image,
                report.lock_path.display()
            );
            for r in &report.refused {
                println!("refused {}: {}", r.requirement, r.reason);
            }
            if !report.refused.is_empty() {
                eprintln!("kernels cannot install the refused packages; fix or remove their lines and sync again");
            }
            eprintln!("send SIGHUP to a running gateway if the allowlist changed");
            Ok(())
        }
    }
}

/// The engine the sync's one-shot runs go to, under `runtime` (Docker's), with the
/// scratch directory the gVisor engine keeps its sandboxes' state in while it runs.
async fn backend(
    engine: &Engine,
    image: &str,
    runtime: RuntimeChoice,
) -> anyhow::Result<(Box<dyn KernelBackend>, Scratch)> {
    if engine.choice == EngineChoice::Docker {
        let docker = DockerBackend::connect(DockerSettings::for_one_shot_runs(image, runtime))
            .await
            .context("cannot reach the Docker engine (is it running? is DOCKER_HOST right?), or use --engine gvisor with an image store")?;
        return Ok((Box::new(docker), Scratch(None)));
    }
    crate::backend::gvisor::check_privileges().map_err(anyhow::Error::msg)?;
    let store = crate::images::ImageStore::open(engine.image_store.clone())
        .context("cannot open the image store (--image-store)")?;
    let resolve: ImageResolver =
        Arc::new(move |r| crate::backend::gvisor::images::resolve(&store, r));
    let scratch = Scratch::new()?;
    let settings = GvisorSettings {
        runsc: engine
            .runsc
            .clone()
            .unwrap_or_else(crate::backend::gvisor::default_runsc),
        image: image.to_owned(),
        runtime_dir: scratch.path().to_owned(),
        memory_mb: 512,
        cpus: 1.0,
        pids: 64,
        disk_mb: 64,
        packages: None,
    };
    let gvisor = GvisorEngine::new(settings, resolve).context("cannot run sandboxes")?;
    Ok((Box::new(gvisor), scratch))
}

/// A private directory for the gVisor engine's state during one command, removed after.
struct Scratch(Option<tempfile::TempDir>);

impl Scratch {
    fn new() -> anyhow::Result<Scratch> {
        let base = Path::new("/run");
        let dir = tempfile::Builder::new()
            .prefix("kernelgate-packages-")
            .tempdir_in(if base.is_dir() {
                base
            } else {
                Path::new("/tmp")
            })
            .context("cannot make a scratch directory for the sandboxes")?;
        Ok(Scratch(Some(dir)))
    }

    fn path(&self) -> &Path {
        self.0
            .as_ref()
            .map_or(Path::new("/nonexistent"), |d| d.path())
    }

    fn remove(mut self) {
        if let Some(dir) = self.0.take() {
            if let Err(e) = dir.close() {
                eprintln!("cannot remove the sandboxes' scratch directory: {e}");
            }
        }
    }
}

/// The file's text, or nothing when it does not exist yet.
fn text_of(file: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(file) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", file.display())),
    }
}

fn add(file: &Path, requirements: &[String]) -> anyhow::Result<()> {
    let mut text = text_of(file)?;
    let mut entries =
        allowlist::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    for r in requirements {
        let entry = allowlist::parse_requirement(r).map_err(anyhow::Error::msg)?;
        if let Some(old) = entries.iter().find(|e| e.name == entry.name) {
            bail!(
                "{} is allowed already (as {:?}); remove it first to change its line",
                entry.name,
                old.requirement
            );
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&entry.requirement);
        text.push('\n');
        entries.push(entry);
    }
    write(file, &text)?;
    eprintln!(
        "allowed {}; now `kernelgate packages sync`, then send SIGHUP to a running gateway",
        requirements.join(", ")
    );
    Ok(())
}

fn remove(file: &Path, names: &[String]) -> anyhow::Result<()> {
    let text = text_of(file)?;
    let wanted: Vec<String> = names
        .iter()
        .map(|n| allowlist::normalize(n.trim()))
        .collect();
    let mut found = Vec::new();
    let kept: String = text
        .lines()
        .filter(|line| {
            let content = line.split('#').next().unwrap_or_default().trim();
            match allowlist::parse_requirement(content) {
                Ok(e) if wanted.contains(&e.name) => {
                    found.push(e.name);
                    false
                }
                _ => true,
            }
        })
        .map(|l| format!("{l}\n"))
        .collect();
    if let Some(missing) = wanted.iter().find(|w| !found.contains(w)) {
        bail!("{missing} is not in {}", file.display());
    }
    write(file, &kept)?;
    eprintln!(
        "removed {}; send SIGHUP to a running gateway",
        found.join(", ")
    );
    Ok(())
}

async fn list(
    file: &Path,
    wheelhouse: Option<&Path>,
    image: &str,
    engine: &Engine,
) -> anyhow::Result<()> {
    let entries = allowlist::read(file).map_err(anyhow::Error::msg)?;
    let locked = match wheelhouse {
        None => None,
        Some(dir) => {
            // Nothing runs: any runtime will do.
            let (backend, scratch) = backend(engine, image, RuntimeChoice::Runc).await?;
            let described = backend.describe_image(image).await;
            drop(backend);
            scratch.remove();
            let id = described
                .with_context(|| format!("cannot inspect the image {image}"))?
                .id;
            lock::Lock::read(&lock::image_dir(dir, &id).join(lock::LOCK_FILE))
                .map_err(anyhow::Error::msg)?
        }
    };
    println!("{:<32} {:<16} BRINGS", "REQUIREMENT", "SYNCED");
    for e in &entries {
        let (synced, brings) = match &locked {
            None if wheelhouse.is_none() => ("-".to_owned(), String::new()),
            None => ("no".to_owned(), String::new()),
            Some(l) => match l.requirements.get(&e.name) {
                Some(r) => (
                    l.packages
                        .get(&e.name)
                        .map_or_else(|| "yes".to_owned(), |p| p.version.clone()),
                    r.packages.join(", "),
                ),
                None => match l.refused.iter().find(|f| {
                    allowlist::parse_requirement(&f.requirement).is_ok_and(|x| x.name == e.name)
                }) {
                    Some(f) => ("refused".to_owned(), f.reason.clone()),
                    None => ("no".to_owned(), String::new()),
                },
            },
        };
        println!("{:<32} {:<16} {}", e.requirement, synced, brings);
    }
    Ok(())
}

fn write(file: &Path, text: &str) -> anyhow::Result<()> {
    // Checked as the gateway will read it.
    allowlist::parse(text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    lock::write_atomically(file, text.as_bytes()).map_err(anyhow::Error::msg)
}
