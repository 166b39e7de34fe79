//! A kernel's sandbox as the tests look at it, whichever engine made it: filled from
//! `docker inspect` under Docker, from the sandbox's OCI bundle (`config.json`, the engine's
//! `meta.json`) and runsc under the gVisor engine. Also the engine-neutral ways to list a
//! gateway's sandboxes, kill one, and read its cgroup on the host.

use crate::engine::{self, Bundle};
use crate::CgroupVersion;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// A directory of the host mounted into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    pub host: String,
    pub sandbox: String,
    pub read_only: bool,
}

/// Which engine's cgroup a sandbox is in on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parent {
    Docker,
    Engine,
}

/// What a kernel's sandbox is, as its engine set it up.
#[derive(Debug, Clone)]
pub struct Sandbox {
    /// The container's id (Docker) or the sandbox's handle (runsc's container id).
    pub id: String,
    /// The OCI runtime: Docker's name of it (`runc`, `kernelgate-runsc`), or `runsc`.
    pub runtime: String,
    pub labels: BTreeMap<String, String>,
    /// `uid:gid` of the kernel's process.
    pub user: String,
    /// Capabilities the kernel's process keeps (none: every one dropped).
    pub capabilities: Vec<String>,
    pub no_new_privileges: bool,
    pub read_only_root: bool,
    /// Each tmpfs mount's path and options.
    pub tmpfs: BTreeMap<String, String>,
    pub memory_bytes: u64,
    /// Memory plus swap (equal to `memory_bytes`: no swap).
    pub memory_swap_bytes: u64,
    /// CPUs the quota allows (quota / period).
    pub cpus: f64,
    pub pids_limit: i64,
    /// Whether the sandbox has a network of its own with loopback only.
    pub no_network: bool,
    pub binds: Vec<Bind>,
    parent: Parent,
}

impl Sandbox {
    /// A container, from `docker inspect`.
    pub fn from_docker(c: &Value) -> Result<Sandbox> {
        let host = &c["HostConfig"];
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        };
        let dropped = strings(&host["CapDrop"]);
        let mut capabilities = strings(&host["CapAdd"]);
        if !dropped.iter().any(|c| c == "ALL") {
            capabilities.push("DEFAULT".to_owned());
        }
        let binds = strings(&host["Binds"])
            .iter()
            .map(|b| {
                let parts: Vec<&str> = b.split(':').collect();
                Bind {
                    host: parts.first().copied().unwrap_or_default().to_owned(),
                    sandbox: parts.get(1).copied().unwrap_or_default().to_owned(),
                    read_only: parts
                        .get(2)
                        .is_some_and(|m| m.split(',').any(|o| o == "ro")),
                }
            })
            .collect();
        let tmpfs = host["Tmpfs"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect();
        let quota = host["CpuQuota"].as_i64().unwrap_or(0);
        let period = host["CpuPeriod"]
            .as_i64()
            .filter(|p| *p > 0)
            .unwrap_or(100_000);
        let nano = host["NanoCpus"].as_i64().unwrap_or(0);
        let cpus = if nano > 0 {
            nano as f64 / 1e9
        } else {
            quota as f64 / period as f64
        };
        Ok(Sandbox {
            id: c["Id"].as_str().context("the container's Id")?.to_owned(),
            runtime: host["Runtime"].as_str().unwrap_or_default().to_owned(),
            labels: labels(&c["Config"]["Labels"]),
            user: c["Config"]["User"].as_str().unwrap_or_default().to_owned(),
            capabilities,
            no_new_privileges: strings(&host["SecurityOpt"])
                .iter()
                .any(|o| o.starts_with("no-new-privileges") && !o.ends_with("false")),
            read_only_root: host["ReadonlyRootfs"] == true,
            tmpfs,
            memory_bytes: host["Memory"].as_u64().unwrap_or(0),
            memory_swap_bytes: host["MemorySwap"].as_u64().unwrap_or(0),
            cpus,
            pids_limit: host["PidsLimit"].as_i64().unwrap_or(0),
            no_network: host["NetworkMode"] == "none",
            binds,
            parent: Parent::Docker,
        })
    }

    /// A sandbox of the gVisor engine, from its bundle.
    pub fn from_bundle(b: &Bundle) -> Result<Sandbox> {
        let c = &b.config;
        let process = &c["process"];
        let user = format!(
            "{}:{}",
            process["user"]["uid"]
                .as_u64()
                .context("process.user.uid")?,
            process["user"]["gid"]
                .as_u64()
                .context("process.user.gid")?
        );
        let mounts: Vec<&Value> = c["mounts"].as_array().into_iter().flatten().collect();
        let options = |m: &Value| -> Vec<String> {
            m["options"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.as_str().map(str::to_owned))
                .collect()
        };
        let tmpfs = mounts
            .iter()
            .filter(|m| m["type"] == "tmpfs" && m["source"] == "tmpfs")
            .filter(|m| m["destination"] != "/dev")
            .map(|m| {
                (
                    m["destination"].as_str().unwrap_or_default().to_owned(),
                    options(m).join(","),
                )
            })
            .collect();
        let binds = mounts
            .iter()
            .filter(|m| m["type"] == "bind")
            .map(|m| Bind {
                host: m["source"].as_str().unwrap_or_default().to_owned(),
                sandbox: m["destination"].as_str().unwrap_or_default().to_owned(),
                read_only: options(m).iter().any(|o| o == "ro"),
            })
            .collect();
        let r = &c["linux"]["resources"];
        let period = r["cpu"]["period"]
            .as_u64()
            .filter(|p| *p > 0)
            .unwrap_or(100_000);
        let capabilities = process["capabilities"]["effective"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_else(|| vec!["DEFAULT".to_owned()]);
        let namespaces = c["linux"]["namespaces"].as_array();
        Ok(Sandbox {
            id: b.handle.clone(),
            runtime: "runsc".to_owned(),
            labels: labels(&b.meta["labels"]),
            user,
            capabilities,
            no_new_privileges: process["noNewPrivileges"] == true,
            read_only_root: c["root"]["readonly"] == true,
            tmpfs,
            memory_bytes: r["memory"]["limit"].as_u64().unwrap_or(0),
            memory_swap_bytes: r["memory"]["swap"].as_u64().unwrap_or(0),
            cpus: r["cpu"]["quota"].as_u64().unwrap_or(0) as f64 / period as f64,
            pids_limit: r["pids"]["limit"].as_i64().unwrap_or(0),
            no_network: namespaces.is_some_and(|n| {
                n.iter()
                    .any(|ns| ns["type"] == "network" && ns.get("path").is_none())
            }),
            binds,
            parent: Parent::Engine,
        })
    }

    /// A file of the sandbox's cgroup, read on the host: `v1` is (controller, file) under
    /// cgroup v1, `v2` the file's name under cgroup v2.
    pub fn cgroup_read(&self, v1: (&str, &str), v2: &str) -> Result<(CgroupVersion, String)> {
        match self.parent {
            Parent::Docker => crate::cgroup_read(&self.id, v1, v2),
            Parent::Engine => {
                let (controller, file) = v1;
                let dir = format!("kernelgate/{}", self.id);
                let v1_path = format!("/sys/fs/cgroup/{controller}/{dir}/{file}");
                if let Ok(text) = std::fs::read_to_string(&v1_path) {
                    return Ok((CgroupVersion::V1, text));
                }
                let v2_path = format!("/sys/fs/cgroup/{dir}/{v2}");
                if let Ok(text) = std::fs::read_to_string(&v2_path) {
                    return Ok((CgroupVersion::V2, text));
                }
                bail!(
                    "no cgroup file {v1_path} or {v2_path} for sandbox {}",
                    self.id
                )
            }
        }
    }
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// The sandbox of kernel `kernel_id` of the gateway on `runtime_dir`.
pub fn sandbox_of(runtime_dir: &Path, kernel_id: &str) -> Result<Sandbox> {
    if !engine::gvisor_engine() {
        return Sandbox::from_docker(&crate::inspect(kernel_id)?);
    }
    let bundles = engine::bundles(runtime_dir);
    // A restart that moved the kernel into a warm sandbox names it there; the sandbox it
    // left still carries its label until it is removed.
    let moved = bundles
        .iter()
        .find(|b| b.meta["serves"].as_str() == Some(kernel_id));
    let own = || {
        bundles
            .iter()
            .find(|b| b.meta["serves"].is_null() && b.kernel_id() == Some(kernel_id))
    };
    match moved.or_else(own) {
        Some(b) => Sandbox::from_bundle(b),
        None => bail!(
            "no sandbox of kernel {kernel_id} under {}",
            engine::bundles_dir(runtime_dir).display()
        ),
    }
}

/// Ids of the sandboxes of the gateway on `runtime_dir` (running ones only when
/// `running`), those with `label` (`key=value`) only when given; sorted.
pub fn sandboxes(runtime_dir: &Path, label: Option<&str>, running: bool) -> Result<Vec<String>> {
    let mut ids = if engine::gvisor_engine() {
        let states: BTreeMap<String, String> =
            engine::runsc_sandboxes(runtime_dir)?.into_iter().collect();
        let dir = runtime_dir.display().to_string();
        engine::bundles(runtime_dir)
            .into_iter()
            .filter(|b| b.meta["labels"]["org.kernelgate.runtime_dir"] == dir.as_str())
            .filter(|b| label.is_none_or(|l| b.has_label(l)))
            .filter(|b| !running || states.get(&b.handle).map(String::as_str) == Some("running"))
            .map(|b| b.handle)
            .collect()
    } else {
        let mut cmd = Command::new("docker");
        cmd.arg("ps");
        if !running {
            cmd.arg("-a");
        }
        cmd.args(["-q", "--no-trunc", "--filter"]).arg(format!(
            "label=org.kernelgate.runtime_dir={}",
            runtime_dir.display()
        ));
        if let Some(label) = label {
            cmd.args(["--filter", &format!("label={label}")]);
        }
        let out = cmd.output()?;
        if !out.status.success() {
            bail!("docker ps: {}", String::from_utf8_lossy(&out.stderr));
        }
        String::from_utf8(out.stdout)?
            .lines()
            .map(str::to_owned)
            .collect::<Vec<String>>()
    };
    ids.sort();
    Ok(ids)
}

/// Kills sandbox `id` (every process in it, SIGKILL) behind the gateway's back, as the
/// host's OOM killer or an operator would.
pub fn kill(runtime_dir: &Path, id: &str) -> Result<()> {
    if engine::gvisor_engine() {
        return engine::runsc_kill(runtime_dir, id, "KILL");
    }
    let out = Command::new("docker").args(["kill", id]).output()?;
    if !out.status.success() {
        bail!("docker kill {id}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}
