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
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio as ChildStdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};

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

/// A process's stdio while runc makes it: for a terminal, the socket runc sends the pty's
/// master through; otherwise the shim's ends of the pipes.
#[derive(Debug)]
pub enum PendingStdio {
    /// The console socket.
    Terminal(ConsoleSocket),
    /// The shim's pipe ends.
    Pipes(ShimEnds),
}

impl PendingStdio {
    /// For a process with `paths` (pipes owned by `uid`/`gid`): what the shim keeps, and the
    /// stdio to hand runc (nothing for a terminal: the pty is the process's stdio).
    pub fn new(
        paths: &StdioPaths,
        uid: u32,
        gid: u32,
    ) -> io::Result<(PendingStdio, Arc<ContainerEnds>)> {
        if paths.terminal {
            return Ok((PendingStdio::Terminal(ConsoleSocket::new()?), nothing()));
        }
        let (ends, shim) = pipes(paths, uid, gid)?;
        Ok((PendingStdio::Pipes(shim), ends))
    }

    /// runc's `--console-socket`, for a terminal.
    pub fn console_socket(&self) -> Option<&Path> {
        match self {
            PendingStdio::Terminal(socket) => Some(socket.path()),
            PendingStdio::Pipes(_) => None,
        }
    }

    /// Once runc has made the process: the copying between it and the fifos of `paths`.
    pub fn start(self, paths: &StdioPaths) -> io::Result<ProcessIo> {
        match self {
            PendingStdio::Terminal(socket) => ProcessIo::copy_console(paths, socket.receive()?),
            PendingStdio::Pipes(shim) => Ok(ProcessIo::copy_pipes(paths, shim)),
        }
    }
}

/// Threads still copying: their count, and a wait for it to reach zero.
#[derive(Debug, Default)]
struct Copies {
    running: Mutex<usize>,
    finished: Condvar,
}

impl Copies {
    /// Runs `copy` in a thread counted here.
    fn spawn(self: &Arc<Self>, copy: impl FnOnce() + Send + 'static) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let copies = Arc::clone(self);
        std::thread::spawn(move || {
            copy();
            let mut running = copies.running.lock().unwrap_or_else(|e| e.into_inner());
            *running -= 1;
            copies.finished.notify_all();
        });
    }

    /// Waits at most `timeout` for every copy to end; whether they did.
    fn wait(&self, timeout: Duration) -> bool {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let (running, _) = self
            .finished
            .wait_timeout_while(running, timeout, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        *running == 0
    }
}

/// The copying of one process's stdio, running.
#[derive(Debug, Default)]
pub struct ProcessIo {
    /// Where the stdin thread writes; taken (closed) at the fifo's end or by `CloseIO`.
    stdin: Arc<Mutex<Option<File>>>,
    /// The stdin copy.
    input: Arc<Copies>,
    /// The stdout and stderr copies.
    output: Arc<Copies>,
    /// The pty's master, for `ResizePty`.
    console: Option<File>,
}

/// How long `CloseIO` lets the stdin copy drain what containerd wrote before it closes the
/// process's input anyway.
const INPUT_DRAIN: Duration = Duration::from_secs(2);

impl ProcessIo {
    /// Starts copying between the fifos of `paths` and the shim's pipe ends.
    pub fn copy_pipes(paths: &StdioPaths, ends: ShimEnds) -> ProcessIo {
        let io = ProcessIo {
            stdin: Arc::new(Mutex::new(ends.stdin)),
            ..ProcessIo::default()
        };
        io.start_input(&paths.stdin);
        if let Some(stdout) = ends.stdout {
            io.start_output(stdout, &paths.stdout);
        }
        if let Some(stderr) = ends.stderr {
            io.start_output(stderr, &paths.stderr);
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
        let io = ProcessIo {
            stdin: Arc::new(Mutex::new(input)),
            console: Some(master.try_clone()?),
            ..ProcessIo::default()
        };
        if !paths.stdout.is_empty() {
            io.start_output(master, &paths.stdout);
        }
        io.start_input(&paths.stdin);
        Ok(io)
    }

    fn start_input(&self, fifo: &str) {
        if fifo.is_empty() {
            return;
        }
        let (writer, fifo) = (Arc::clone(&self.stdin), PathBuf::from(fifo));
        self.input.spawn(move || {
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

    /// Copies `from` into the fifo at `path` until `from` ends. The fifo is opened read-write,
    /// so that the open never waits for a reader and a reader that goes away does not end the
    /// copy.
    fn start_output(&self, mut from: File, path: &str) {
        let path = PathBuf::from(path);
        self.output.spawn(move || {
            let Ok(mut to) = OpenOptions::new().read(true).write(true).open(&path) else {
                // Nobody can read it: drain, so that the process does not block on a full pipe.
                let _ = io::copy(&mut from, &mut io::sink());
                return;
            };
            let _ = io::copy(&mut from, &mut to);
        });
    }

    /// `CloseIO`: the process's stdin reaches its end once the copy has passed on what
    /// containerd wrote before (containerd closes its end of the fifo, then asks).
    pub fn close_stdin(&self) {
        let (stdin, input) = (Arc::clone(&self.stdin), Arc::clone(&self.input));
        std::thread::spawn(move || {
            input.wait(INPUT_DRAIN);
            stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
        });
    }

    /// The output copies, to wait for without holding the process.
    pub fn output_waiter(&self) -> OutputWaiter {
        OutputWaiter(Arc::clone(&self.output))
    }

    /// `ResizePty`.
    pub fn resize(&self, width: u32, height: u32) -> io::Result<()> {
        let Some(console) = &self.console else {
            return Err(io::Error::other("the process has no terminal"));
        };
        let size = rustix::termios::Winsize {
            ws_row: height as u16,
            ws_col: width as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        rustix::termios::tcsetwinsize(console, size).map_err(io::Error::from)
    }
}

/// A process's output copies, waited for apart from the process ([`ProcessIo::output_waiter`]).
#[derive(Clone, Debug)]
pub struct OutputWaiter(Arc<Copies>);

impl OutputWaiter {
    /// Waits at most `timeout` for them to end; whether they did.
    pub fn wait(&self, timeout: Duration) -> bool {
        self.0.wait(timeout)
    }
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
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        rustix::net::recvmsg(&stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(mut fds) = message {
                if let Some(fd) = fds.next() {
                    return Ok(File::from(fd));
                }
            }
        }
        Err(io::Error::other(
            "runc sent no terminal on the console socket",
        ))
    }
}
