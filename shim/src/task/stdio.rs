//! A process's stdio as containerd hands it over (fifo paths, possibly empty, and whether it
//! has a terminal), and the copying between those fifos and the process.
//!
//! As containerd's runc shim does: without a terminal the process gets pipes, and one thread
//! per stream copies between a pipe and its fifo, so that the process never sees a fifo's
//! open or close; with a terminal, runc hands the pty's master over a console socket
//! ([`ConsoleSocket`]) and the threads copy between the master and the fifos. An empty path
//! is `/dev/null`.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio as ChildStdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

/// The fifos containerd named for a process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StdioPaths {
    /// Where the process's input comes from (empty: none).
    pub stdin: String,
    /// Where its output goes (empty: nowhere).
    pub stdout: String,
    /// Where its errors go (empty: nowhere).
    pub stderr: String,
    /// Whether it runs on a terminal.
    pub terminal: bool,
}

/// The container's ends of its stdio pipes, handed to `runc create`/`runc exec` and closed in
/// the shim once runc has passed them on.
#[derive(Debug)]
pub struct ContainerEnds {
    ends: Mutex<[Option<OwnedFd>; 3]>,
}

/// The shim's ends: where it writes the process's input and reads its output.
#[derive(Debug, Default)]
pub struct ShimEnds {
    stdin: Option<File>,
    stdout: Option<File>,
    stderr: Option<File>,
}

fn pipe(uid: u32, gid: u32) -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (uid, gid) = (Some(uid.into()), Some(gid.into()));
    nix::unistd::fchown(&read, uid, gid)?;
    Ok((read, write))
}

/// Pipes for the streams that have a fifo, owned by `uid`/`gid` (runtime options `io_uid`,
/// `io_gid`).
pub fn pipes(paths: &StdioPaths, uid: u32, gid: u32) -> io::Result<(Arc<ContainerEnds>, ShimEnds)> {
    let mut ends: [Option<OwnedFd>; 3] = [None, None, None];
    let mut shim = ShimEnds::default();
    if !paths.stdin.is_empty() {
        let (read, write) = pipe(uid, gid)?;
        ends[0] = Some(read);
        shim.stdin = Some(File::from(write));
    }
    if !paths.stdout.is_empty() {
        let (read, write) = pipe(uid, gid)?;
        ends[1] = Some(write);
        shim.stdout = Some(File::from(read));
    }
    if !paths.stderr.is_empty() {
        let (read, write) = pipe(uid, gid)?;
        ends[2] = Some(write);
        shim.stderr = Some(File::from(read));
    }
    let ends = ContainerEnds {
        ends: Mutex::new(ends),
    };
    Ok((Arc::new(ends), shim))
}

/// No stdio at all (a terminal process: its stdio is the pty).
pub fn nothing() -> Arc<ContainerEnds> {
    Arc::new(ContainerEnds {
        ends: Mutex::new([None, None, None]),
    })
}

impl runc::Io for ContainerEnds {
    fn set(&self, cmd: &mut Command) -> io::Result<()> {
        let ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        let stdio = |end: &Option<OwnedFd>| -> io::Result<ChildStdio> {
            Ok(match end {
                Some(fd) => ChildStdio::from(fd.try_clone()?),
                None => ChildStdio::null(),
            })
        };
        cmd.stdin(stdio(&ends[0])?);
        cmd.stdout(stdio(&ends[1])?);
        cmd.stderr(stdio(&ends[2])?);
        Ok(())
    }

    fn close_after_start(&self) {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        *ends = [None, None, None];
    }
}

/// The copying of one process's stdio, running.
#[derive(Debug, Default)]
pub struct ProcessIo {
    /// Where the stdin thread writes; taken (closed) by `CloseIO` or at the fifo's end.
    stdin: Arc<Mutex<Option<File>>>,
    /// The pty's master, for `ResizePty`.
    console: Option<File>,
}

impl ProcessIo {
    /// Starts copying between the fifos of `paths` and the shim's pipe ends.
    pub fn copy_pipes(paths: &StdioPaths, ends: ShimEnds) -> ProcessIo {
        let io = ProcessIo {
            stdin: Arc::new(Mutex::new(ends.stdin)),
            console: None,
        };
        io.start_input(&paths.stdin);
        if let Some(stdout) = ends.stdout {
            copy_out(stdout, &paths.stdout);
        }
        if let Some(stderr) = ends.stderr {
            copy_out(stderr, &paths.stderr);
        }
        io
    }

    /// Starts copying between the fifos of `paths` and a terminal's master.
    pub fn copy_console(paths: &StdioPaths, master: File) -> io::Result<ProcessIo> {
        let input = if paths.stdin.is_empty() {
            None
        } else {
            Some(master.try_clone()?)
        };
        if !paths.stdout.is_empty() {
            copy_out(master.try_clone()?, &paths.stdout);
        }
        let io = ProcessIo {
            stdin: Arc::new(Mutex::new(input)),
            console: Some(master),
        };
        io.start_input(&paths.stdin);
        Ok(io)
    }

    fn start_input(&self, fifo: &str) {
        if fifo.is_empty() {
            return;
        }
        let (writer, fifo) = (Arc::clone(&self.stdin), PathBuf::from(fifo));
        std::thread::spawn(move || {
            // Blocks until containerd's side opens it for writing.
            if let Ok(mut input) = File::open(&fifo) {
                let mut buf = vec![0u8; 32 * 1024];
                while let Ok(n) = input.read(&mut buf) {
                    let mut slot = writer.lock().unwrap_or_else(|e| e.into_inner());
                    let Some(out) = slot.as_mut() else { return };
                    if n == 0 || out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
            // The end of the input: the process reads EOF.
            writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        });
    }

    /// `CloseIO`: the process's stdin reaches its end.
    pub fn close_stdin(&self) {
        self.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// `ResizePty`.
    pub fn resize(&self, width: u32, height: u32) -> io::Result<()> {
        let Some(console) = &self.console else {
            return Err(io::Error::other("the process has no terminal"));
        };
        let size = libc::winsize {
            ws_row: height as u16,
            ws_col: width as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize from the pointer, which outlives the call.
        let rc = unsafe { libc::ioctl(console.as_raw_fd(), libc::TIOCSWINSZ, &size) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Copies `from` into the fifo at `path` until `from` ends. The fifo is opened read-write, so
/// that the open never waits for a reader and a reader that goes away does not kill the copy.
fn copy_out(mut from: File, path: &str) {
    let path = PathBuf::from(path);
    std::thread::spawn(move || {
        let Ok(mut to) = OpenOptions::new().read(true).write(true).open(&path) else {
            // Nobody can read it: drain, so that the process does not block on a full pipe.
            let _ = io::copy(&mut from, &mut io::sink());
            return;
        };
        let _ = io::copy(&mut from, &mut to);
    });
}

/// The socket runc sends a new terminal's master through (`--console-socket`).
#[derive(Debug)]
pub struct ConsoleSocket {
    _dir: tempfile::TempDir,
    path: PathBuf,
    listener: UnixListener,
}

impl ConsoleSocket {
    /// A socket in a new private directory.
    pub fn new() -> io::Result<ConsoleSocket> {
        let dir = tempfile::Builder::new().prefix("gpuplex-pty").tempdir()?;
        let path = dir.path().join("pty.sock");
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        Ok(ConsoleSocket {
            _dir: dir,
            path,
            listener,
        })
    }

    /// The path to give runc.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The master runc sent (runc sends it before `create` or `exec --detach` returns).
    pub fn receive(&self) -> io::Result<File> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let stream = loop {
            match self.listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        };
        stream.set_nonblocking(false)?;
        let mut name = [0u8; 4096];
        let mut iov = [io::IoSliceMut::new(&mut name)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                if let Some(&fd) = fds.first() {
                    // SAFETY: the kernel just gave this process the descriptor; nothing else
                    // owns it.
                    return Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) });
                }
            }
        }
        Err(io::Error::other(
            "runc sent no terminal on the console socket",
        ))
    }
}
