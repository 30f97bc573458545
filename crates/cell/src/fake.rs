//! A second tier behind the boundary, for tests of everything above it: a "cell" is a
//! directory of the host and its processes are plain host processes (each in a process group
//! of its own), so the harness can be driven through create, exec, pause, kill and approvals by
//! an ordinary user, without root and without any of the kernel's isolation. **It isolates
//! nothing**; it exists only behind the `fake` feature, which no shipped binary enables.
//!
//! What a real tier's gateway would ask, a test asks through [`FakeCell::ask`]; what the
//! harness answers is kept in [`FakeCell::answers`].

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use warden_policy::Tier;

use crate::tier::{
    Attached, Backend, Cell, CellError, CellSpec, Check, Ending, ExecEvent, ExecRequest, FileOp,
    Question, Session, StartError, Status,
};

/// Cells as directories under `root`.
#[derive(Debug)]
pub struct FakeBackend {
    root: PathBuf,
    cells: Mutex<HashMap<String, Arc<FakeCell>>>,
    /// Names whose start is refused, with what to say.
    refuse: Mutex<HashMap<String, String>>,
    /// How long each start takes (none by default).
    start_delay: Mutex<std::time::Duration>,
    /// How long each kill takes before the cell ends (none by default).
    kill_delay: Mutex<std::time::Duration>,
}

impl FakeBackend {
    pub fn new(root: &Path) -> Arc<Self> {
        Arc::new(Self {
            root: root.to_path_buf(),
            cells: Mutex::new(HashMap::new()),
            refuse: Mutex::new(HashMap::new()),
            start_delay: Mutex::new(std::time::Duration::ZERO),
            kill_delay: Mutex::new(std::time::Duration::ZERO),
        })
    }

    /// Each kill of a cell started from now on takes `delay` before the cell ends (a tier
    /// whose cells take time to stop); [`FakeCell::kill_begun`] says when one has begun.
    pub fn delay_kills(&self, delay: std::time::Duration) {
        if let Ok(mut d) = self.kill_delay.lock() {
            *d = delay;
        }
    }

    /// Each start from now on takes `delay` (a tier whose cells take time to come up).
    pub fn delay_starts(&self, delay: std::time::Duration) {
        if let Ok(mut d) = self.start_delay.lock() {
            *d = delay;
        }
    }

    /// The cell of this name, as the harness made it.
    pub fn cell(&self, name: &str) -> Option<Arc<FakeCell>> {
        self.cells.lock().ok()?.get(name).cloned()
    }

    /// The directory of a cell about to start, unless its start is to be refused.
    fn cell_dir(&self, name: &str) -> Result<PathBuf, StartError> {
        if let Some(message) = self.refuse.lock().ok().and_then(|mut r| r.remove(name)) {
            return Err(StartError::Refused(message));
        }
        let dir = self.root.join(name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| StartError::Host(format!("creating {}: {e}", dir.display())))?;
        Ok(dir)
    }

    /// The next start of a cell named `name` fails with `message`.
    pub fn refuse_start(&self, name: &str, message: &str) {
        if let Ok(mut refuse) = self.refuse.lock() {
            refuse.insert(name.to_owned(), message.to_owned());
        }
    }
}

impl Backend for FakeBackend {
    fn tier(&self) -> Tier {
        Tier::Process
    }

    fn check_name(&self, name: &str) -> Result<(), CellError> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if ok {
            Ok(())
        } else {
            Err(CellError::Invalid(format!(
                "invalid cell name `{name}`: use 1-64 letters, digits, `-` or `_`"
            )))
        }
    }

    fn check(
        &self,
        _policy: &warden_policy::Policy,
        _workspace: Option<&Path>,
    ) -> Result<(), CellError> {
        Ok(())
    }

    fn start(&self, spec: CellSpec) -> Result<Arc<dyn Cell>, StartError> {
        let delay = self
            .start_delay
            .lock()
            .map_or(std::time::Duration::ZERO, |d| *d);
        std::thread::sleep(delay);
        let dir = self.cell_dir(&spec.name)?;
        let cell = Arc::new(FakeCell {
            name: spec.name.clone(),
            dir,
            env: spec.env.clone(),
            spec,
            paused: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            kill_delay: self
                .kill_delay
                .lock()
                .map_or(std::time::Duration::ZERO, |d| *d),
            kill_begun: AtomicBool::new(false),
            groups: Mutex::new(Vec::new()),
            questions: Mutex::new(Vec::new()),
            answers: Mutex::new(Vec::new()),
            next_question: AtomicU64::new(1),
            look_delay: Mutex::new(std::time::Duration::ZERO),
            slow_look_begun: AtomicBool::new(false),
        });
        if let Ok(mut cells) = self.cells.lock() {
            cells.insert(cell.name.clone(), Arc::clone(&cell));
        }
        Ok(cell)
    }

    fn run_attached(
        &self,
        spec: CellSpec,
        argv: Vec<std::ffi::OsString>,
        _discard_changes: bool,
        before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
    ) -> Result<Attached, StartError> {
        let dir = self.cell_dir(&spec.name)?;
        let Some((program, args)) = argv.split_first() else {
            return Err(StartError::Refused("no command".to_owned()));
        };
        before_start().map_err(StartError::Host)?;
        let ending = match Command::new(program)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&dir)
            .status()
        {
            Ok(status) => match (status.code(), status.signal()) {
                (Some(code), _) => Ending::Exited(code),
                (None, Some(signal)) => Ending::Signaled(signal),
                (None, None) => Ending::Exited(255),
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                Ending::CommandNotFound(format!("{}: not found", program.to_string_lossy()))
            }
            Err(err) => Ending::CannotExecute(format!("{}: {err}", program.to_string_lossy())),
        };
        Ok(Attached {
            name: spec.name,
            ending,
            notices: Vec::new(),
            kept_changes: false,
            release: Default::default(),
        })
    }

    fn adopt(&self, name: &str) -> Result<Option<Arc<dyn Cell>>, CellError> {
        Ok(self
            .cell(name)
            .filter(|c| !c.ended.load(Ordering::SeqCst))
            .map(|c| c as Arc<dyn Cell>))
    }

    fn layers(&self) -> Option<crate::tier::Layers> {
        // Its cells are plain directories: no copy-on-write workspace.
        None
    }

    fn probe(&self) -> Vec<Check> {
        Vec::new()
    }
}

/// One fake cell.
#[derive(Debug)]
pub struct FakeCell {
    name: String,
    dir: PathBuf,
    env: Vec<(String, String)>,
    spec: CellSpec,
    paused: AtomicBool,
    ended: AtomicBool,
    /// How long a kill takes before the cell ends.
    kill_delay: std::time::Duration,
    kill_begun: AtomicBool,
    /// Process groups of the processes started in it.
    groups: Mutex<Vec<i32>>,
    questions: Mutex<Vec<Question>>,
    answers: Mutex<Vec<(u64, bool)>>,
    next_question: AtomicU64,
    /// How long the next look at its status takes (a tier whose look is slow on a busy host).
    look_delay: Mutex<std::time::Duration>,
    slow_look_begun: AtomicBool,
}

impl FakeCell {
    /// The spec the harness made it from.
    pub fn spec(&self) -> &CellSpec {
        &self.spec
    }

    /// Its directory (the working directory of its processes).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// The next look at its status (`Cell::status`) takes `delay` before it answers.
    pub fn delay_next_look(&self, delay: std::time::Duration) {
        if let Ok(mut d) = self.look_delay.lock() {
            *d = delay;
        }
    }

    /// Whether the look that [`FakeCell::delay_next_look`] slowed down has begun.
    pub fn slow_look_begun(&self) -> bool {
        self.slow_look_begun.load(Ordering::SeqCst)
    }

    /// Whether a kill of it has begun (it may not have ended yet: see
    /// [`FakeBackend::delay_kills`]).
    pub fn kill_begun(&self) -> bool {
        self.kill_begun.load(Ordering::SeqCst)
    }

    /// As a gateway's `ask` rule would: a question that waits for an answer; its id.
    pub fn ask(&self, request: &str, destination: &str, rule: &str) -> u64 {
        let id = self.next_question.fetch_add(1, Ordering::SeqCst);
        let asked_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if let Ok(mut q) = self.questions.lock() {
            q.push(Question {
                id,
                request: request.to_owned(),
                destination: destination.to_owned(),
                rule: rule.to_owned(),
                asked_at,
                timeout_s: 300,
            });
        }
        id
    }

    /// The answers the harness gave, in order: question id and whether it allowed.
    pub fn answers(&self) -> Vec<(u64, bool)> {
        self.answers.lock().map(|a| a.clone()).unwrap_or_default()
    }

    fn signal_all(&self, signal: Signal) {
        if let Ok(groups) = self.groups.lock() {
            for &group in groups.iter() {
                let _ = killpg(Pid::from_raw(group), signal);
            }
        }
    }

    fn ended(&self) -> CellError {
        CellError::Ended(format!("cell `{}` has ended", self.name))
    }
}

impl Cell for FakeCell {
    fn name(&self) -> &str {
        &self.name
    }

    fn pid(&self) -> Option<i32> {
        None
    }

    fn status(&self) -> Result<Status, CellError> {
        let delay = self
            .look_delay
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default();
        if !delay.is_zero() {
            self.slow_look_begun.store(true, Ordering::SeqCst);
            std::thread::sleep(delay);
        }
        Ok(if self.ended.load(Ordering::SeqCst) {
            Status::Ended
        } else if self.is_paused() {
            Status::Paused
        } else {
            Status::Running
        })
    }

    fn oom_kills(&self) -> Option<u64> {
        None
    }

    fn usage(&self) -> Option<warden_protocol::CellUsage> {
        None
    }

    fn freeze(&self) -> Result<(), CellError> {
        if self.ended.load(Ordering::SeqCst) {
            return Err(self.ended());
        }
        self.signal_all(Signal::SIGSTOP);
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn thaw(&self) -> Result<(), CellError> {
        if self.ended.load(Ordering::SeqCst) {
            return Err(self.ended());
        }
        self.paused.store(false, Ordering::SeqCst);
        self.signal_all(Signal::SIGCONT);
        Ok(())
    }

    fn kill(&self) -> Result<(), CellError> {
        self.kill_begun.store(true, Ordering::SeqCst);
        if !self.kill_delay.is_zero() && !self.ended.load(Ordering::SeqCst) {
            std::thread::sleep(self.kill_delay);
        }
        if self.ended.swap(true, Ordering::SeqCst) {
            return Err(self.ended());
        }
        self.signal_all(Signal::SIGKILL);
        self.signal_all(Signal::SIGCONT);
        Ok(())
    }

    fn exec(
        &self,
        request: &ExecRequest,
        stdio: Option<[&OwnedFd; 3]>,
    ) -> Result<Arc<dyn Session>, CellError> {
        if self.ended.load(Ordering::SeqCst) {
            return Err(self.ended());
        }
        let Some([stdin, stdout, stderr]) = stdio else {
            return Err(CellError::Unsupported(
                "the fake tier has no terminals".to_owned(),
            ));
        };
        let host = |e: std::io::Error| CellError::Host(format!("fake exec: {e}"));
        let (ready_r, ready_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
                .map_err(|e| host(e.into()))?;
        let session = Arc::new(FakeSession {
            ready: ready_r,
            events: Mutex::new(VecDeque::new()),
            group: Mutex::new(None),
        });
        let mut command = Command::new(&request.argv[0]);
        command
            .args(&request.argv[1..])
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(request.env.iter().map(|(k, v)| (k, v)))
            .current_dir(
                request
                    .cwd
                    .as_deref()
                    .map(Path::new)
                    .filter(|p| p.is_dir())
                    .unwrap_or(&self.dir),
            )
            .stdin(Stdio::from(stdin.try_clone().map_err(host)?))
            .stdout(Stdio::from(stdout.try_clone().map_err(host)?))
            .stderr(Stdio::from(stderr.try_clone().map_err(host)?))
            .process_group(0);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(err) => {
                let code = if err.kind() == std::io::ErrorKind::NotFound {
                    127
                } else {
                    126
                };
                session.push(
                    &ready_w,
                    ExecEvent::Failed {
                        id: 0,
                        code,
                        message: format!("{}: {err}", request.argv[0]),
                    },
                );
                return Ok(session);
            }
        };
        let pid = child.id() as i32;
        if let Ok(mut group) = session.group.lock() {
            *group = Some(pid);
        }
        if let Ok(mut groups) = self.groups.lock() {
            groups.push(pid);
        }
        if self.is_paused() {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGSTOP);
        }
        session.push(&ready_w, ExecEvent::Started { id: 0, pid });
        let waiter = Arc::clone(&session);
        std::thread::spawn(move || {
            let event = match child.wait() {
                Ok(status) => match (status.code(), status.signal()) {
                    (Some(code), _) => ExecEvent::Exited {
                        id: 0,
                        code,
                        usage: None,
                    },
                    (None, Some(signal)) => ExecEvent::Signaled {
                        id: 0,
                        signal,
                        usage: None,
                    },
                    (None, None) => ExecEvent::Exited {
                        id: 0,
                        code: 255,
                        usage: None,
                    },
                },
                Err(_) => ExecEvent::Exited {
                    id: 0,
                    code: 255,
                    usage: None,
                },
            };
            waiter.push(&ready_w, event);
        });
        Ok(session)
    }

    fn file_op(
        &self,
        _root: &str,
        _op: &FileOp,
        _stdio: [&OwnedFd; 3],
    ) -> Result<Arc<dyn Session>, CellError> {
        Err(CellError::Unsupported(
            "the fake tier has no file service".to_owned(),
        ))
    }

    fn questions(&self) -> Vec<Question> {
        self.questions.lock().map(|q| q.clone()).unwrap_or_default()
    }

    fn answer(&self, id: u64, allow: bool) -> Result<(), CellError> {
        let mut questions = self
            .questions
            .lock()
            .map_err(|_| CellError::Host("poisoned".to_owned()))?;
        let Some(at) = questions.iter().position(|q| q.id == id) else {
            return Err(CellError::Invalid(format!("no open question {id}")));
        };
        questions.remove(at);
        if let Ok(mut answers) = self.answers.lock() {
            answers.push((id, allow));
        }
        Ok(())
    }

    fn set_network_rules(&self, _file: &Path) -> Result<u64, CellError> {
        Ok(0)
    }
}

/// A fake process's events: queued, with one byte in a pipe per event for readiness.
#[derive(Debug)]
struct FakeSession {
    ready: OwnedFd,
    events: Mutex<VecDeque<ExecEvent>>,
    group: Mutex<Option<i32>>,
}

impl FakeSession {
    fn push(&self, ready: &OwnedFd, event: ExecEvent) {
        if let Ok(mut events) = self.events.lock() {
            events.push_back(event);
        }
        let _ = nix::unistd::write(ready, &[1]);
    }
}

impl AsRawFd for FakeSession {
    fn as_raw_fd(&self) -> RawFd {
        self.ready.as_raw_fd()
    }
}

impl Session for FakeSession {
    fn try_next_event(&self) -> Result<Option<(ExecEvent, Vec<OwnedFd>)>, CellError> {
        let mut byte = [0u8; 1];
        match nix::unistd::read(&self.ready, &mut byte) {
            Ok(1) => {}
            Ok(_) => return Err(CellError::Ended("the fake process is gone".to_owned())),
            Err(nix::errno::Errno::EAGAIN) => return Ok(None),
            Err(e) => return Err(CellError::Host(format!("fake events: {e}"))),
        }
        let event = self.events.lock().ok().and_then(|mut e| e.pop_front());
        Ok(event.map(|e| (e, Vec::new())))
    }

    fn signal(&self, signal: i32) -> Result<(), CellError> {
        let group = self.group.lock().ok().and_then(|g| *g);
        if let (Some(group), Ok(signal)) = (group, Signal::try_from(signal)) {
            let _ = killpg(Pid::from_raw(group), signal);
        }
        Ok(())
    }
}
