//! The documents say what exists: the README's Layout names exactly the repository's
//! top-level folders and what it lists inside them exists (every module folder of the
//! gateway among it), docs/architecture.md's module list names exactly the modules of each
//! crate and its allowed imports are the only ones the gateway's modules make, and every relative link in the README and docs/ leads to a file (and heading)
//! that exists; every figure of `make bench` that the README and docs/performance.md quote
//! is the one the committed samples (docs/bench-results.json) give. Generated tables (the
//! audit records, the API's operations) are checked by the gateway's unit tests.

use anyhow::{Context, Result};
use kernelgate_tests::bench_report;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The lines of the first fenced block after `heading` in `file`.
fn block_after(file: &str, heading: &str) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(root().join(file))?;
    let at = text
        .find(heading)
        .with_context(|| format!("{file} has no {heading:?}"))?;
    let rest = &text[at..];
    let open = rest.find("```").context("a fenced block")? + 3;
    let body = &rest[open..];
    let body = &body[body.find('\n').unwrap_or(0) + 1..];
    let close = body.find("```").context("the block's end")?;
    Ok(body[..close].lines().map(str::to_owned).collect())
}

/// The names listed at `indent` spaces (a name ends at the first space).
fn names_at(lines: &[String], indent: usize) -> BTreeSet<String> {
    lines
        .iter()
        .filter(|l| l.len() > indent && l[..indent].trim().is_empty())
        .filter(|l| !l[indent..].starts_with(' '))
        .filter_map(|l| l[indent..].split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_readme_layout_names_every_top_level_folder() -> Result<()> {
    let listed = names_at(&block_after("README.md", "## Layout")?, 0);
    let out = std::process::Command::new("git")
        .args(["ls-files"])
        .current_dir(root())
        .output()?;
    let tracked: BTreeSet<String> = String::from_utf8(out.stdout)?
        .lines()
        .filter_map(|p| p.split_once('/').map(|(dir, _)| format!("{dir}/")))
        .filter(|d| !d.starts_with('.'))
        .collect();
    assert_eq!(listed, tracked, "README.md's Layout against the tree");
    Ok(())
}

#[test]
fn the_architecture_lists_every_module() -> Result<()> {
    let lines = block_after("docs/architecture.md", "## Crates and modules")?;
    // Each crate's line at column 0, its modules at two spaces until the next crate.
    let mut crates: Vec<(String, Vec<String>)> = Vec::new();
    for line in lines {
        if !line.starts_with(' ') && !line.is_empty() {
            let name = line
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned();
            crates.push((name, Vec::new()));
        } else if let Some((_, body)) = crates.last_mut() {
            body.push(line);
        }
    }
    let manifest = std::fs::read_to_string(root().join("Cargo.toml"))?;
    let members: toml::Value = manifest.parse()?;
    let members: Vec<String> = members["workspace"]["members"]
        .as_array()
        .context("the workspace's members")?
        .iter()
        .filter_map(|m| m.as_str().map(|m| format!("{m}/")))
        .collect();
    let mut checked = 0;
    for (krate, body) in &crates {
        let src = root().join(krate).join("src");
        if !members.contains(krate) || !src.is_dir() {
            continue;
        }
        let listed = names_at(body, 2);
        let present: BTreeSet<String> = std::fs::read_dir(&src)?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let dir = e.path().is_dir();
                match name.as_str() {
                    "lib.rs" | "main.rs" | "tests.rs" => None,
                    _ if dir => Some(format!("{name}/")),
                    _ if name.ends_with(".rs") => Some(name),
                    _ => None,
                }
            })
            .collect();
        assert_eq!(listed, present, "docs/architecture.md's modules of {krate}");
        checked += 1;
    }
    let listed: Vec<&String> = crates.iter().map(|(k, _)| k).collect();
    for member in &members {
        assert!(
            listed.contains(&member) || member == "tests/",
            "docs/architecture.md does not list the crate {member}"
        );
    }
    assert!(
        checked >= 3,
        "protocol, policy and gateway at least: {crates:?}"
    );
    Ok(())
}

/// One level down: each entry the README's Layout lists under a top-level folder exists
/// there, and every module folder of the gateway's source (`gateway/src/<dir>/`) is listed.
#[test]
fn the_readme_layout_names_what_is_inside_the_folders() -> Result<()> {
    let lines = block_after("README.md", "## Layout")?;
    let mut top = String::new();
    let mut listed = BTreeSet::new();
    for line in &lines {
        if !line.starts_with(' ') && !line.is_empty() {
            top = line
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned();
        } else if line.len() > 2 && line.starts_with("  ") && !line[2..].starts_with(' ') {
            let entry = line[2..].split_whitespace().next().unwrap_or_default();
            let path = format!("{top}{entry}");
            assert!(
                root().join(&path).exists(),
                "README.md's Layout lists {path}, which does not exist"
            );
            listed.insert(path);
        }
    }
    for dir in std::fs::read_dir(root().join("gateway/src"))? {
        let dir = dir?;
        if dir.path().is_dir() {
            let path = format!("gateway/src/{}/", dir.file_name().to_string_lossy());
            assert!(
                listed.contains(&path),
                "README.md's Layout does not list {path}"
            );
        }
    }
    Ok(())
}

/// The gateway's modules import each other only as docs/architecture.md's "Allowed imports"
/// says (`crate::<module>` in code that is not a test's).
#[test]
fn every_gateway_module_imports_only_what_the_architecture_allows() -> Result<()> {
    let allowed: std::collections::BTreeMap<String, BTreeSet<String>> =
        block_after("docs/architecture.md", "### Allowed imports")?
            .iter()
            .filter_map(|l| {
                let mut words = l.split_whitespace().map(str::to_owned);
                Some((words.next()?, words.collect()))
            })
            .collect();
    let src = root().join("gateway/src");
    let import = regex::Regex::new(r"crate::(\w+)")?;
    let mut checked = 0;
    for entry in std::fs::read_dir(&src)? {
        let path = entry?.path();
        let name = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if ["lib", "main", "generated_docs"].contains(&name.as_str()) {
            continue;
        }
        let may = allowed
            .get(&name)
            .with_context(|| format!("docs/architecture.md's Allowed imports has no {name}"))?;
        for file in rust_files(&path)? {
            let base = file.file_name().unwrap_or_default().to_string_lossy();
            // Test code: test modules in their own files, the fake engine, the contract.
            if base.ends_with("tests.rs") || base == "fake.rs" || base == "contract.rs" {
                continue;
            }
            let text = std::fs::read_to_string(&file)?;
            let code = text
                .find("#[cfg(test)]\nmod ")
                .map_or(text.as_str(), |at| &text[..at]);
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for used in import.captures_iter(line) {
                    let used = &used[1];
                    assert!(
                        used == name || may.contains(used),
                        "{} imports crate::{used}, which docs/architecture.md does not allow {name}",
                        file.display()
                    );
                }
            }
        }
        checked += 1;
    }
    assert!(checked >= 15, "the gateway's modules: {checked}");
    Ok(())
}

/// Files a reader can hold: no source file of the crates that ship (protocol, policy,
/// client, gateway) passes 700 lines, its test module aside; test-only files (`tests.rs`,
/// `*_tests.rs`, the fake engine) and the vendored zeromq crate are not counted. The tests
/// crate is test code throughout.
#[test]
fn no_shipped_source_file_passes_700_lines() -> Result<()> {
    let mut long = Vec::new();
    let mut checked = 0;
    for krate in ["protocol", "policy", "client", "gateway"] {
        for file in rust_files(&root().join(krate).join("src"))? {
            let base = file.file_name().unwrap_or_default().to_string_lossy();
            if base.ends_with("tests.rs") || base == "fake.rs" {
                continue;
            }
            let text = std::fs::read_to_string(&file)?;
            let all: Vec<&str> = text.lines().collect();
            // Up to an inline test module (`#[cfg(test)]` then `mod name {`).
            let lines = all
                .windows(2)
                .position(|w| {
                    w[0] == "#[cfg(test)]" && w[1].starts_with("mod ") && w[1].ends_with('{')
                })
                .unwrap_or(all.len());
            if lines > 700 {
                long.push(format!("{} ({lines} lines)", file.display()));
            }
            checked += 1;
        }
    }
    assert!(long.is_empty(), "split by concern: {long:?}");
    assert!(checked > 100, "the crates' files: {checked}");
    Ok(())
}

/// The Rust files of a module: the file, or every file under its folder.
fn rust_files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path)? {
        files.extend(rust_files(&entry?.path())?);
    }
    Ok(files
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
        .collect())
}

/// GitHub's anchor for a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_relative_link_in_the_documents_resolves() -> Result<()> {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs"))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let anchors = |p: &Path| -> BTreeSet<String> {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with('#'))
            .map(|l| slug(l.trim_start_matches('#')))
            .collect()
    };
    let link = regex::Regex::new(r"\]\(([^)\s]+)\)")?;
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file)?;
        for m in link.captures_iter(&text) {
            let target = &m[1];
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
            let dest = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap_or(Path::new(".")).join(path)
            };
            if !dest.exists() {
                broken.push(format!("{}: {target} (no such file)", file.display()));
            } else if !anchor.is_empty()
                && dest.extension().is_some_and(|x| x == "md")
                && !anchors(&dest).contains(anchor)
            {
                broken.push(format!("{}: {target} (no such heading)", file.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    Ok(())
}

/// The committed samples of the full `make bench` run the documents quote.
fn samples() -> Result<Value> {
    let path = root().join("docs/bench-results.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

/// The measured figures left in `text`: a number with a unit of time, size, ratio or share
/// (`1.07x`, `4.7 %`, `981 ms`, `0.24 s`, `295 MiB`, `17 minutes`). Workload sizes (what
/// the bench prints, not what it measured) are not figures.
fn figures(text: &str) -> Result<Vec<String>> {
    let figure = regex::Regex::new(
        r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x\b| ?%| ?ms\b| ?µs\b| s\b| MiB\b| minutes\b)",
    )?;
    let workloads = ["20 MiB", "100 MiB"];
    Ok(figure
        .find_iter(text)
        .map(|m| m.as_str().to_owned())
        .filter(|f| !workloads.contains(&f.as_str()))
        .collect())
}

/// What is left of `text` once every markdown table line and every sentence of `generated`
/// is taken out: prose that no bench run produced.
fn unrendered(text: &str, generated: &[String]) -> String {
    let mut rest = kernelgate::text::one_line(
        &text
            .lines()
            .filter(|l| !l.starts_with('|'))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    for g in generated {
        let g = kernelgate::text::one_line(g);
        if !g.is_empty() {
            rest = rest.replace(&g, " ");
        }
    }
    rest
}

#[test]
fn the_readme_figures_are_the_committed_samples() -> Result<()> {
    let doc = samples()?;
    let figures_of_the_run = bench_report::readme(&doc)
        .context("docs/bench-results.json lacks a part of a full run the README quotes")?;
    let readme = std::fs::read_to_string(root().join("README.md"))?;
    let lines: Vec<&str> = readme.lines().collect();
    for table in &figures_of_the_run.tables {
        let want: Vec<&str> = table.lines().collect();
        assert!(
            lines.windows(want.len()).any(|w| w == want.as_slice()),
            "README.md should quote this table as the samples give it \
             (`bench --render docs/bench-results.json`):\n{table}"
        );
    }
    let flat = kernelgate::text::one_line(&readme);
    for phrase in &figures_of_the_run.phrases {
        assert!(
            flat.contains(&kernelgate::text::one_line(phrase)),
            "README.md should say {phrase:?}, as the samples give it"
        );
    }
    let left = figures(&unrendered(&readme, &figures_of_the_run.phrases))?;
    assert!(
        left.is_empty(),
        "README.md quotes figures no committed sample gives: {left:?}"
    );
    Ok(())
}

#[test]
fn the_performance_tables_are_the_committed_samples() -> Result<()> {
    let doc = samples()?;
    let rendered = bench_report::markdown(&doc);
    let rendered_lines: BTreeSet<&str> = rendered.lines().collect();
    let text = std::fs::read_to_string(root().join("docs/performance.md"))?;
    let hand_made: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with('|') && !rendered_lines.contains(l))
        .collect();
    assert!(
        hand_made.is_empty(),
        "docs/performance.md has table rows the samples do not give \
         (`bench --render docs/bench-results.json` prints them):\n{}",
        hand_made.join("\n")
    );
    let paragraphs: Vec<String> = rendered.lines().map(str::to_owned).collect();
    let left = figures(&unrendered(&text, &paragraphs))?;
    assert!(
        left.is_empty(),
        "docs/performance.md quotes figures no committed sample gives: {left:?}"
    );
    Ok(())
}
