//! The test hosts cluster tests run on: namespaces on a switch reach each other on
//! 198.18.0.0/15 and nothing else, a cut or a blocked peer stops traffic until healed, and
//! everything is gone once the net is dropped.

use anyhow::{Context, Result};
use kernelgate_tests::netns::{Host, Net};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

/// A one-line TCP server in `host` on port 7000: answers `pong` to every connection.
async fn serve(net: &Net, host: &Host) -> Result<tokio::process::Child> {
    let script = format!(
        "import socket\ns = socket.socket()\ns.bind(('{}', 7000))\ns.listen()\nprint('ready', flush=True)\n\
         while True:\n    c, _ = s.accept()\n    c.sendall(b'pong')\n    c.close()",
        host.ip
    );
    let mut child = net
        .command(host, "python3")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).await?;
    anyhow::ensure!(line.trim() == "ready", "server: {line}");
    Ok(child)
}

/// Whether `from` reaches `ip`:7000 within a second.
async fn reaches(net: &Net, from: &Host, ip: &str) -> Result<bool> {
    let script = format!(
        "import socket\ns = socket.create_connection(('{ip}', 7000), timeout=1)\nprint(s.recv(4).decode())"
    );
    let out = net
        .command(from, "python3")
        .args(["-c", &script])
        .output()
        .await?;
    Ok(String::from_utf8_lossy(&out.stdout).trim() == "pong")
}

/// Whether `from` reaches `ip` within 5 s (a link just brought up takes a moment).
async fn comes_through(net: &Net, from: &Host, ip: &str) -> Result<bool> {
    for _ in 0..10 {
        if reaches(net, from, ip).await? {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(false)
}

fn routes(host: &Host) -> Result<String> {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", host.netns))
        .args(["ip", "route"])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_on_a_switch_partition_and_heal() -> Result<()> {
    let subnet = 200 + (std::process::id() % 50) as u8;
    let names;
    {
        let mut net = Net::new(subnet)?;
        let a = net.add_host("a", 1)?;
        let b = net.add_host("b", 2)?;
        let c = net.add_host("c", 3)?;
        names = [a.netns.clone(), b.netns.clone(), c.netns.clone()];
        // The only route is the switch's subnet: no default route, no way out.
        let r = routes(&b)?;
        assert_eq!(r.lines().count(), 1, "{r}");
        assert!(r.starts_with(&format!("198.18.{subnet}.0/24")), "{r}");

        let _server = serve(&net, &a).await?;
        assert!(comes_through(&net, &b, &a.ip).await?);
        assert!(comes_through(&net, &c, &a.ip).await?);

        net.cut(&a)?;
        assert!(!reaches(&net, &b, &a.ip).await?, "a is cut off");
        net.heal(&a)?;
        assert!(comes_through(&net, &b, &a.ip).await?, "healed");

        net.block(&a, &b.ip)?;
        assert!(!reaches(&net, &b, &a.ip).await?, "a drops b");
        assert!(comes_through(&net, &c, &a.ip).await?, "c still reaches a");
        net.unblock(&a, &b.ip)?;
        assert!(comes_through(&net, &b, &a.ip).await?);
    }
    let left = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()?;
    let left = String::from_utf8_lossy(&left.stdout);
    for name in names {
        assert!(!left.contains(&name), "{name} outlived its net: {left}");
    }
    Ok(())
}
