//! `kernelgate packages add|remove|list|sync`.

use super::{allowlist, lock, sync};
use crate::config::{PackagesAction, PackagesArgs};
use anyhow::{bail, Context};
use std::path::Path;

pub async fn run(args: PackagesArgs) -> anyhow::Result<()> {
    let file = args.file().map_err(anyhow::Error::msg)?;
    match args.action {
        PackagesAction::Add { requirements } => add(&file, &requirements),
        PackagesAction::Remove { names } => remove(&file, &names),
        PackagesAction::List { wheelhouse, image } => {
            list(&file, wheelhouse.as_deref(), &image).await
        }
        PackagesAction::Sync {
            wheelhouse,
            find_links,
            image,
            python,
        } => {
            let entries = allowlist::read(&file).map_err(anyhow::Error::msg)?;
            if entries.is_empty() {
                bail!("{} allows no package: add some with `kernelgate packages add NAME --packages {}`", file.display(), file.display());
            }
            let docker = docker().await?;
            let opts = sync::SyncOptions {
                entries,
                wheelhouse,
                find_links,
                image,
                python,
            };
            let report = sync::sync(&docker, &opts, &mut |line: &str| eprintln!("{line}")).await?;
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

async fn docker() -> anyhow::Result<bollard::Docker> {
    bollard::Docker::connect_with_local_defaults()
        .context("cannot reach the Docker engine")?
        .negotiate_version()
        .await
        .context("cannot reach the Docker engine (is it running? is DOCKER_HOST right?)")
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

async fn list(file: &Path, wheelhouse: Option<&Path>, image: &str) -> anyhow::Result<()> {
    let entries = allowlist::read(file).map_err(anyhow::Error::msg)?;
    let locked = match wheelhouse {
        None => None,
        Some(dir) => {
            let docker = docker().await?;
            let id = docker
                .inspect_image(image)
                .await
                .with_context(|| format!("cannot inspect the image {image}"))?
                .id
                .unwrap_or_default();
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
