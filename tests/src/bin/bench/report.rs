//! The machine description of a benchmark run; its tables are `kernelgate_tests::bench_report`.

use crate::procs::Paths;
use serde_json::{json, Value};

pub use kernelgate_tests::bench_report::markdown;

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn output(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

pub fn loadavg() -> String {
    read("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// CPU, memory, OS, Docker and the versions of everything measured.
pub async fn machine(paths: &Paths) -> Value {
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default();
    let mem_gib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or_default();
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_default();
    let python = paths.venv.join("bin/python");
    let versions = output(
        &python.display().to_string(),
        &[
            "-c",
            "import sys, kernel_gateway, jupyter_server, ipykernel, matplotlib; \
             print(f'jupyter_kernel_gateway {kernel_gateway.__version__}, jupyter_server \
             {jupyter_server.__version__}, ipykernel {ipykernel.__version__}, matplotlib \
             {matplotlib.__version__}, Python {sys.version.split()[0]}')",
        ],
    );
    json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": (mem_gib * 10.0).round() / 10.0,
        "os": os,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "docker": output("docker", &["version", "--format", "{{.Server.Version}}"]),
        "kernelgate": output(&paths.kernelgate.display().to_string(), &["--version"]),
        "image": paths.image,
        "local_kernels": versions,
        "load_before": loadavg(),
    })
}
