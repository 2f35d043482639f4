//! Building and running the project's binaries as child processes that
//! never outlive the command (killed on drop, and on Ctrl-C with the
//! process group).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Builds `packages`' binaries and returns the directory they are in.
pub(crate) fn build(root: &Path, release: bool, packages: &[&str]) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(root).arg("build").arg("--quiet");
    if release {
        cmd.arg("--release");
    }
    for p in packages {
        cmd.args(["-p", p]);
    }
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("cargo build failed");
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    Ok(target.join(if release { "release" } else { "debug" }))
}

/// A child process, killed when dropped.
#[derive(Debug)]
pub(crate) struct Proc {
    pub(crate) name: String,
    child: tokio::process::Child,
}

impl Proc {
    /// Starts `bin args…`, its output appended to `log`.
    pub(crate) fn spawn(name: &str, bin: &Path, args: &[String], log: &Path) -> Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let child = tokio::process::Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    /// Starts a prepared command (arguments, environment), its output
    /// appended to `log`.
    pub(crate) fn spawn_command(
        name: &str,
        mut cmd: tokio::process::Command,
        log: &Path,
    ) -> Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    /// The process id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Fails if the process has exited.
    pub(crate) fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited early ({status})", self.name);
        }
        Ok(())
    }

    /// Kills the process (SIGKILL) without waiting for it: until
    /// [`Proc::stop`] reaps it, its `/proc/PID/stat` (CPU time) stays
    /// readable.
    pub(crate) fn kill(&mut self) -> Result<()> {
        self.child.start_kill()?;
        Ok(())
    }

    /// Stops the process and waits for it.
    pub(crate) async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }
}

/// Waits until `GET url` answers 200, or fails after `within`.
pub(crate) async fn wait_ok(url: &str, within: Duration, proc: &mut Proc) -> Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        proc.check_running()?;
        if let Ok((200, _)) = crate::load::get(url).await {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{url} did not answer 200 within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs a bench's `main` on a new runtime; Ctrl-C ends it with 130 (its
/// children are killed on drop).
pub(crate) fn run_until_ctrl_c(
    main: impl std::future::Future<Output = Result<std::process::ExitCode>>,
) -> Result<std::process::ExitCode> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        tokio::select! {
            r = main => r,
            _ = tokio::signal::ctrl_c() => Ok(std::process::ExitCode::from(130)),
        }
    })
}
