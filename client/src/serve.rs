//! A `kernelgate serve` of our own: the binary started on a free loopback port (or on an
//! address of a network namespace, through a launcher such as `nsenter`), waited for until
//! it listens, stopped with SIGTERM (so it removes its kernel containers).

use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// Why a local gateway did not start or stop.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("no free port: {0}")]
    NoPort(std::io::Error),
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error("it exited ({0})")]
    Exited(ExitStatus),
    #[error("it did not listen on {host}:{port} within {timeout:?}")]
    NotListening {
        host: IpAddr,
        port: u16,
        timeout: Duration,
    },
    #[error("it did not stop within {0:?} of SIGTERM; killed")]
    NotStopped(Duration),
    #[error("waiting for it: {0}")]
    Wait(std::io::Error),
}

/// A free port on 127.0.0.1 (free when asked: another process may take it before use).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// How to start `kernelgate serve`: `[LAUNCHER...] PROGRAM serve --listen HOST:PORT ARGS...`.
#[derive(Debug)]
pub struct Serve {
    program: PathBuf,
    launcher: Vec<OsString>,
    host: IpAddr,
    port: u16,
    args: Vec<OsString>,
    envs: Vec<(OsString, Option<OsString>)>,
    own_group: bool,
    timeout: Duration,
}

impl Serve {
    /// `program serve` on a free loopback port.
    pub fn new(program: impl Into<PathBuf>) -> Result<Serve, ServeError> {
        Ok(Serve {
            program: program.into(),
            launcher: Vec::new(),
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: free_port().map_err(ServeError::NoPort)?,
            args: Vec::new(),
            envs: Vec::new(),
            own_group: false,
            timeout: Duration::from_secs(60),
        })
    }

    /// The port it will listen on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Listens on `host` instead of 127.0.0.1 (an address of the namespace a launcher
    /// puts it in; it must be reachable from where the caller runs).
    pub fn host(mut self, host: IpAddr) -> Serve {
        self.host = host;
        self
    }

    /// Runs it through `launcher` (a program and its arguments, e.g. `nsenter
    /// --net=/var/run/netns/NAME`), which must `exec` it: the process started is the
    /// gateway, so signals reach it.
    pub fn launcher<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, launcher: I) -> Serve {
        self.launcher = launcher.into_iter().map(Into::into).collect();
        self
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Serve {
        self.args.push(arg.into());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Serve {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Serve {
        self.envs.push((key.into(), Some(value.into())));
        self
    }

    pub fn env_remove(mut self, key: impl Into<OsString>) -> Serve {
        self.envs.push((key.into(), None));
        self
    }

    /// In a process group of its own, so a Ctrl-C meant for us does not reach it.
    pub fn own_process_group(mut self) -> Serve {
        self.own_group = true;
        self
    }

    /// How long it may take to listen (default 60 s).
    pub fn listen_timeout(mut self, timeout: Duration) -> Serve {
        self.timeout = timeout;
        self
    }

    /// Starts it and returns once it accepts connections. Every line it prints goes to
    /// `on_line` with the stream it came on, until it closes its output.
    pub async fn start(
        self,
        on_line: impl Fn(Output, &str) + Send + Sync + 'static,
    ) -> Result<LocalGateway, ServeError> {
        let mut command = match self.launcher.split_first() {
            Some((launcher, args)) => {
                let mut c = Command::new(launcher);
                c.args(args).arg(&self.program);
                c
            }
            None => Command::new(&self.program),
        };
        let listen = std::net::SocketAddr::new(self.host, self.port);
        command
            .arg("serve")
            .args(["--listen", &listen.to_string()])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (key, value) in &self.envs {
            match value {
                Some(v) => command.env(key, v),
                None => command.env_remove(key),
            };
        }
        if self.own_group {
            command.process_group(0);
        }
        let mut child = command.spawn().map_err(|source| ServeError::Spawn {
            program: self.program.clone(),
            source,
        })?;
        forward_lines(&mut child, Arc::new(on_line));
        let mut gateway = LocalGateway {
            child: Some(child),
            host: self.host,
            port: self.port,
        };
        match gateway.wait_listening(self.timeout).await {
            Ok(()) => Ok(gateway),
            Err(e) => {
                let _ = gateway.stop(Duration::from_secs(30)).await;
                Err(e)
            }
        }
    }
}

/// A running `kernelgate serve` that we started; killed if dropped while it runs.
#[derive(Debug)]
pub struct LocalGateway {
    child: Option<Child>,
    host: IpAddr,
    port: u16,
}

impl LocalGateway {
    async fn wait_listening(&mut self, timeout: Duration) -> Result<(), ServeError> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(ServeError::Exited(status));
                }
            }
            if TcpStream::connect((self.host, self.port)).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(ServeError::NotListening {
            host: self.host,
            port: self.port,
            timeout,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://HOST:PORT` (`http://127.0.0.1:PORT` unless [`Serve::host`] said otherwise).
    pub fn base(&self) -> String {
        format!("http://{}", std::net::SocketAddr::new(self.host, self.port))
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Whether it has been stopped or killed through this handle.
    pub fn is_stopped(&self) -> bool {
        self.child.is_none()
    }

    /// SIGKILL, as a crash would.
    pub async fn kill(&mut self) -> Result<(), ServeError> {
        match self.child.take() {
            Some(mut child) => child.kill().await.map_err(ServeError::Wait),
            None => Ok(()),
        }
    }

    /// SIGTERM, so it removes its kernel containers, and waits for it; SIGKILL if it does
    /// not stop within `grace`.
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus, ServeError> {
        let Some(mut child) = self.child.take() else {
            return Err(ServeError::Wait(std::io::Error::other("already stopped")));
        };
        if let Some(pid) = child.id() {
            terminate(pid);
        }
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => status.map_err(ServeError::Wait),
            Err(_) => {
                let _ = child.kill().await;
                Err(ServeError::NotStopped(grace))
            }
        }
    }

    /// SIGTERM, then waits (blocking, up to `grace`) until it is gone: for `Drop`.
    pub fn stop_blocking(&mut self, grace: Duration) {
        let Some(pid) = self.pid() else { return };
        terminate(pid);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && alive(pid) {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn terminate(pid: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
}

fn alive(pid: u32) -> bool {
    std::process::Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Which of its outputs a line came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Stdout,
    Stderr,
}

type OnLine = Arc<dyn Fn(Output, &str) + Send + Sync>;

/// Hands every line the child prints to `on_line`.
fn forward_lines(child: &mut Child, on_line: OnLine) {
    let readers: [(Output, Option<Box<dyn AsyncRead + Send + Unpin>>); 2] = [
        (
            Output::Stdout,
            child.stdout.take().map(|s| Box::new(s) as _),
        ),
        (
            Output::Stderr,
            child.stderr.take().map(|s| Box::new(s) as _),
        ),
    ];
    for (output, reader) in readers {
        let Some(reader) = reader else { continue };
        let on_line = on_line.clone();
        // Ends when the child closes its output, at the latest when it exits.
        tokio::spawn(async move {
            let mut lines = BufReader::new(reader).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                on_line(output, &line);
            }
        });
    }
}
