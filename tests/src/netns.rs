//! Test hosts for cluster tests: network namespaces joined by veth pairs to a bridge that
//! lives in a "switch" namespace of its own, with addresses in 198.18.0.0/15 (the
//! benchmarking range). Everything a [`Net`] creates carries its prefix (`kg-<n>`) and is
//! removed when it is dropped, also when a test fails. A bridge in the root namespace would
//! meet Docker's FORWARD policy, hence the switch namespace; `nsenter --net=` (not `ip netns
//! exec`) keeps the cgroup mounts a gateway needs visible.

use anyhow::{bail, Context, Result};
use std::process::Command;

/// The first two octets of every test host's address.
const SUBNET: &str = "198.18";

/// A switch and the hosts plugged into it.
#[derive(Debug)]
pub struct Net {
    prefix: String,
    /// Which /24 of 198.18.0.0/15 this net uses (nets of parallel tests do not meet).
    subnet: u8,
    hosts: Vec<Host>,
}

/// One test host: a network namespace with one interface on the switch.
#[derive(Debug, Clone)]
pub struct Host {
    /// The namespace's name (`kg-<n>-<name>`).
    pub netns: String,
    /// Its address on the switch.
    pub ip: String,
    /// The switch end of its veth pair, in the switch namespace.
    port: String,
}

fn command(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("cannot run {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Net {
    /// An empty switch. `subnet` (0-255) picks the /24 of 198.18.0.0/16 its hosts get.
    pub fn new(subnet: u8) -> Result<Net> {
        let prefix = format!("kg-{}{}", std::process::id() % 10_000, subnet);
        let net = Net {
            prefix,
            subnet,
            hosts: Vec::new(),
        };
        let switch = net.switch();
        command(&["ip", "netns", "add", &switch])?;
        net.exec_in(&switch, &["ip", "link", "set", "lo", "up"])?;
        net.exec_in(
            &switch,
            &["ip", "link", "add", "name", "br0", "type", "bridge"],
        )?;
        net.exec_in(&switch, &["ip", "link", "set", "br0", "up"])?;
        Ok(net)
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// Runs `args` inside namespace `netns`.
    fn exec_in(&self, netns: &str, args: &[&str]) -> Result<()> {
        let path = format!("--net=/var/run/netns/{netns}");
        let mut all = vec!["nsenter", path.as_str()];
        all.extend_from_slice(args);
        command(&all)
    }

    /// Adds host number `n` (1-250) called `name`: its namespace, a veth pair to the switch
    /// and address 198.18.<subnet>.<n>/24.
    pub fn add_host(&mut self, name: &str, n: u8) -> Result<Host> {
        let netns = format!("{}-{name}", self.prefix);
        // Interface names: at most 15 characters.
        let port = format!("p{}{n}", self.prefix.trim_start_matches("kg-"));
        let port = port.chars().take(15).collect::<String>();
        let ip = format!("{SUBNET}.{}.{n}", self.subnet);
        command(&["ip", "netns", "add", &netns])?;
        let host = Host {
            netns: netns.clone(),
            ip: ip.clone(),
            port: port.clone(),
        };
        self.hosts.push(host.clone());
        self.exec_in(&netns, &["ip", "link", "set", "lo", "up"])?;
        let switch_path = format!("/var/run/netns/{}", self.switch());
        self.exec_in(
            &netns,
            &[
                "ip", "link", "add", "name", "eth0", "type", "veth", "peer", "name", &port,
            ],
        )?;
        self.exec_in(&netns, &["ip", "link", "set", &port, "netns", &switch_path])?;
        self.exec_in(
            &netns,
            &["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"],
        )?;
        self.exec_in(&netns, &["ip", "link", "set", "eth0", "up"])?;
        let switch = self.switch();
        self.exec_in(&switch, &["ip", "link", "set", &port, "master", "br0"])?;
        self.exec_in(&switch, &["ip", "link", "set", &port, "up"])?;
        Ok(host)
    }

    /// Cuts `host` off the switch (its link down): a full partition.
    pub fn cut(&self, host: &Host) -> Result<()> {
        self.exec_in(&self.switch(), &["ip", "link", "set", &host.port, "down"])
    }

    /// Plugs `host` back in.
    pub fn heal(&self, host: &Host) -> Result<()> {
        self.exec_in(&self.switch(), &["ip", "link", "set", &host.port, "up"])
    }

    /// Inside `host`, drops its traffic to and from `peer_ip` (a partial partition:
    /// the rest of the switch still reaches it).
    pub fn block(&self, host: &Host, peer_ip: &str) -> Result<()> {
        for (chain, flag) in [("OUTPUT", "-d"), ("INPUT", "-s")] {
            self.exec_in(
                &host.netns,
                &["iptables", "-A", chain, flag, peer_ip, "-j", "DROP"],
            )?;
        }
        Ok(())
    }

    /// Undoes [`Net::block`].
    pub fn unblock(&self, host: &Host, peer_ip: &str) -> Result<()> {
        for (chain, flag) in [("OUTPUT", "-d"), ("INPUT", "-s")] {
            self.exec_in(
                &host.netns,
                &["iptables", "-D", chain, flag, peer_ip, "-j", "DROP"],
            )?;
        }
        Ok(())
    }

    /// A command that runs `program` inside `host` (spawn it as usual).
    pub fn command(&self, host: &Host, program: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("nsenter");
        c.arg(format!("--net=/var/run/netns/{}", host.netns))
            .arg(program)
            .kill_on_drop(true);
        c
    }
}

impl Host {
    /// The command that runs a program inside this host: put it before the program's own.
    pub fn launcher(&self) -> [String; 2] {
        ["nsenter".to_owned(), format!("--net={}", self.path())]
    }

    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.netns)
    }
}

/// Moves the calling thread into `host`'s network namespace: sockets it opens from now on
/// are the host's. Other threads are not moved.
fn enter(host: &Host) -> Result<()> {
    use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};
    use std::os::fd::AsFd;
    let ns = std::fs::File::open(host.path())
        .with_context(|| format!("cannot open the namespace of {}", host.netns))?;
    move_into_link_name_space(ns.as_fd(), Some(LinkNameSpaceType::Network))
        .with_context(|| format!("cannot enter {}", host.netns))
}

/// Runs `body` as a client inside `host`: on a thread of its own and a Tokio runtime whose
/// every thread is in the host's namespace, so each connection it makes leaves from the
/// host. The caller's thread stays where it is.
pub fn run_in<T: Send>(
    host: &Host,
    body: impl std::future::Future<Output = Result<T>> + Send,
) -> Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                enter(host)?;
                let inside = host.clone();
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .on_thread_start(move || {
                        if let Err(e) = enter(&inside) {
                            panic!("a client thread outside its test host: {e}");
                        }
                    })
                    .build()?;
                runtime.block_on(body)
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace removes its end of each veth pair, and with it the pair.
        for host in &self.hosts {
            let _ = command(&["ip", "netns", "delete", &host.netns]);
        }
        let _ = command(&["ip", "netns", "delete", &self.switch()]);
    }
}
