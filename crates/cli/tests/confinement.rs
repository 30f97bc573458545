//! Each confinement of a process-tier cell, proven by an attempt that fails inside a real cell.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::Read as _;
use std::net::TcpListener;
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::fs::PermissionsExt;

use support::*;

/// Python snippet: call `expr` (a libc call returning -1 on failure) and print the errno name.
fn errno_of(setup: &str, expr: &str) -> String {
    format!(
        "import ctypes, errno, os\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         {setup}\n\
         r = {expr}\n\
         print('errno', errno.errorcode.get(ctypes.get_errno(), 'OK') if r == -1 else 'OK')"
    )
}

#[test]
fn writes_outside_workspace_and_tmp_are_denied() {
    let ws = tempdir();
    let ran = run_sh(
        &[
            "--policy",
            &direct_policy(),
            "--workspace",
            ws.path().to_str().unwrap(),
        ],
        "for p in /etc/x /usr/x /x /proc/sys/kernel/hostname /dev/x; do \
           if echo pwned > $p 2>/dev/null; then echo WROTE $p; else echo denied $p; fi; done; \
         echo ok > /workspace/inside && echo ok > /tmp/inside && echo writable",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    for path in [
        "/etc/x",
        "/usr/x",
        "/x",
        "/proc/sys/kernel/hostname",
        "/dev/x",
    ] {
        assert!(
            ran.stdout.contains(&format!("denied {path}\n")),
            "{path}: {ran:?}"
        );
    }
    assert!(!ran.stdout.contains("WROTE"), "{ran:?}");
    assert!(ran.stdout.ends_with("writable\n"), "{ran:?}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("inside")).unwrap(),
        "ok\n"
    );
    assert!(!std::path::Path::new("/x").exists() && !std::path::Path::new("/usr/x").exists());
}

#[test]
fn host_secret_outside_the_policy_is_unreadable() {
    let dir = tempdir();
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "TOPSECRET-4711").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let path = secret.to_str().unwrap();
    let ran = run_sh(
        &[],
        &format!("cat {path} /etc/shadow /root/.bashrc /home 2>&1; cat /etc/passwd"),
    );
    assert!(!ran.stdout.contains("TOPSECRET"), "{ran:?}");
    assert!(
        ran.stdout
            .contains(&format!("cat: {path}: No such file or directory")),
        "{ran:?}"
    );
    assert!(
        ran.stdout
            .contains("cat: /etc/shadow: No such file or directory"),
        "{ran:?}"
    );
    // The cell's /etc/passwd is generated, not the host's.
    let host_passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    assert!(host_passwd.lines().count() > 3);
    assert!(ran.stdout.contains("cell:x:1000:1000"), "{ran:?}");
    assert!(!ran.stdout.contains("daemon:x:1:1"), "{ran:?}");
}

#[test]
fn host_processes_are_invisible_and_cannot_be_signalled() {
    let mut host = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pid = host.id();
    let ran = run_sh(
        &[],
        &format!(
            "ls /proc | grep -E '^[0-9]+$' | tr '\\n' ' '; echo; kill -0 {pid} 2>&1 || echo cannot-signal; kill -9 1 2>&1; echo alive"
        ),
    );
    let still_running = host.try_wait().unwrap().is_none();
    host.kill().unwrap();
    let _ = host.wait();
    assert!(still_running, "the host process was killed from the cell");
    assert!(ran.stdout.contains("cannot-signal"), "{ran:?}");
    let pids: Vec<u32> = ran
        .stdout
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert!(
        pids.iter().all(|p| *p < 20),
        "cell sees host pids: {pids:?}"
    );
    assert!(pids.contains(&1), "{pids:?}");
}

#[test]
fn the_wardens_command_line_with_host_paths_is_not_visible_in_the_cell() {
    let workspace = tempdir();
    let host_path = workspace.path().to_str().unwrap().to_owned();
    let ran = run_sh(
        &["--workspace", &host_path],
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let init = ran.stdout.lines().next().unwrap_or_default();
    assert_eq!(init.trim(), "warden-init", "{ran:?}");
    assert!(!ran.stdout.contains(&host_path), "{ran:?}");
    assert!(!ran.stdout.contains("--workspace"), "{ran:?}");
}

#[test]
fn the_mount_table_names_no_host_path_of_the_workspace_or_the_warden() {
    let workspace = tempdir();
    let state = tempdir();
    let runtime = tempdir();
    std::fs::set_permissions(runtime.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let host_path = workspace.path().to_str().unwrap().to_owned();
    let name = unique("mounts");
    let env = |cmd: &mut std::process::Command| {
        cmd.env("WARDEN_STATE_DIR", state.path())
            .env("WARDEN_RUNTIME_DIR", runtime.path());
    };
    let mut cmd = warden();
    env(&mut cmd);
    let ran = Ran::from(
        cmd.args(["run", "--name", &name, "--workspace", &host_path, "--"])
            .args([
                "sh",
                "-c",
                "echo x > /workspace/f; cat /proc/self/mountinfo /proc/self/mounts; ls -a /",
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    // A fork stacks a snapshot under its layer: still nothing of the host.
    let mut snap = warden();
    env(&mut snap);
    assert!(
        snap.args(["snapshot", &name, "--as", "s"])
            .status()
            .unwrap()
            .success()
    );
    let mut fork = warden();
    env(&mut fork);
    let forked = Ran::from(
        fork.args([
            "fork",
            &format!("{name}@s"),
            "--name",
            &format!("{name}-f"),
            "--",
        ])
        .args(["sh", "-c", "cat /workspace/f /proc/self/mountinfo"])
        .output()
        .unwrap(),
    );
    assert_eq!(forked.code, 0, "{forked:?}");
    assert!(forked.stdout.starts_with("x\n"), "{forked:?}");
    for text in [&ran.stdout, &forked.stdout] {
        for host in [
            host_path.as_str(),
            state.path().to_str().unwrap(),
            runtime.path().to_str().unwrap(),
        ] {
            assert!(!text.contains(host), "{host} shows in the cell: {text}");
        }
        assert!(!text.contains(".warden"), "{text}");
    }
    for cell in [format!("{name}-f"), name.clone()] {
        let mut rm = warden();
        env(&mut rm);
        let _ = rm.args(["rm", &cell]).status();
    }
    let mut rm = warden();
    env(&mut rm);
    let _ = rm.args(["rm", &format!("{name}@s")]).status();
}

#[test]
fn ptrace_is_refused() {
    let ran = run_py(&[], &errno_of("", "libc.ptrace(0, 0, 0, 0)"));
    assert_eq!(ran.stdout.trim(), "errno EPERM", "{ran:?}");
}

#[test]
fn mount_is_refused() {
    let ran = run_py(
        &[],
        &errno_of("", "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)"),
    );
    assert_eq!(ran.stdout.trim(), "errno EPERM", "{ran:?}");
    let ran = run_sh(&[], "mount -t tmpfs none /tmp 2>&1; echo status=$?");
    assert!(
        ran.stdout.contains("status=32") || ran.stdout.contains("status=1"),
        "{ran:?}"
    );
}

#[test]
fn new_user_namespace_is_refused() {
    let ran = run_py(&[], &errno_of("", "libc.unshare(0x10000000)"));
    assert_eq!(ran.stdout.trim(), "errno EPERM", "{ran:?}");
    let ran = run_sh(&[], "unshare -U -r id 2>&1; echo status=$?");
    assert!(!ran.stdout.contains("uid=0"), "{ran:?}");
    assert!(!ran.stdout.contains("status=0"), "{ran:?}");
}

#[test]
fn bpf_is_refused() {
    let ran = run_py(
        &[],
        &errno_of(
            "buf = ctypes.create_string_buffer(128)",
            "libc.syscall(321, 0, buf, 128)",
        ),
    );
    assert_eq!(ran.stdout.trim(), "errno EPERM", "{ran:?}");
}

#[test]
fn io_uring_is_refused() {
    let ran = run_py(
        &[],
        &errno_of(
            "params = ctypes.create_string_buffer(120)",
            "libc.syscall(425, 4, params)",
        ),
    );
    assert_eq!(ran.stdout.trim(), "errno EPERM", "{ran:?}");
}

#[test]
fn terminal_injection_with_tiocsti_is_refused() {
    let code = "import os, fcntl, termios, errno\n\
                m, s = os.openpty()\n\
                try:\n    fcntl.ioctl(s, termios.TIOCSTI, b'x'); print('injected')\n\
                except OSError as e: print('errno', errno.errorcode[e.errno])\n\
                print('tty' if os.isatty(0) else 'no-tty')";
    let ran = run_py(&[], code);
    assert_eq!(ran.stdout, "errno EPERM\nno-tty\n", "{ran:?}");
}

/// Each cell is in a network namespace of its own (as root one made on a thread of its own
/// while the run plans the cell, and the cell cloned inside it), whose one device is its
/// loopback, up, and which nothing in the cell may change. Two cells at once: each its own.
#[test]
fn each_cell_has_a_network_of_its_own_with_its_loopback_alone() {
    let code = "import os, socket, fcntl, struct, errno, time\n\
                print(os.readlink('/proc/self/ns/net'))\n\
                devices = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n\
                print(' '.join(sorted(devices)))\n\
                s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n\
                c = socket.create_connection(s.getsockname(), timeout=5)\n\
                a, _ = s.accept(); c.sendall(b'x'); print('loopback', a.recv(1).decode())\n\
                try:\n\
                \x20   fcntl.ioctl(c, 0x8914, struct.pack('16sh', b'lo', 0)); print('changed')\n\
                except OSError as e: print('errno', errno.errorcode[e.errno])\n\
                time.sleep(1)";
    let cells: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(move || run_py(&[], code)))
        .collect();
    let ran: Vec<Ran> = cells.into_iter().map(|c| c.join().unwrap()).collect();
    let host = std::fs::read_link("/proc/self/ns/net").unwrap();
    let mut seen = Vec::new();
    for ran in &ran {
        let lines: Vec<&str> = ran.stdout.lines().collect();
        assert_eq!(
            lines.get(1..),
            Some(&["lo", "loopback x", "errno EPERM"][..]),
            "{ran:?}"
        );
        let ns = lines[0];
        assert!(ns.starts_with("net:["), "{ran:?}");
        assert_ne!(
            std::path::Path::new(ns),
            host,
            "a cell is in the host's network"
        );
        seen.push(ns.to_owned());
    }
    assert_ne!(
        seen[0], seen[1],
        "two cells at once share a network namespace"
    );
}

#[test]
fn tcp_to_a_host_loopback_listener_is_unreachable() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let code = format!(
        "import socket, errno\n\
         s = socket.socket()\n\
         try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n\
         except OSError as e: print('errno', errno.errorcode[e.errno])"
    );
    let ran = run_py(&[], &code);
    assert_eq!(ran.stdout.trim(), "errno ECONNREFUSED", "{ran:?}");
    assert!(
        listener.accept().is_err(),
        "the host listener received a connection from the cell"
    );
}

#[test]
fn sockets_of_families_past_the_allowed_ones_are_refused() {
    // vsock, packet, netlink past routes; then key, rds, can, tipc, bluetooth, alg, xdp:
    // families a cell has no use for, whose first socket loads a module on many hosts.
    let code = "import socket, errno\n\
                for fam, typ, proto in [(40, 1, 0), (17, 3, 0), (16, 3, 9), (15, 3, 2), (21, 5, 0), (29, 3, 1), (30, 5, 0), (31, 1, 0), (38, 5, 0), (44, 3, 0)]:\n\
                \x20   try:\n\
                \x20       socket.socket(fam, typ, proto); print(fam, 'opened')\n\
                \x20   except OSError as e: print(fam, errno.errorcode[e.errno])\n\
                socket.socket(16, 3, 0); print('route netlink ok')\n\
                socket.socket(socket.AF_INET6, socket.SOCK_STREAM); socket.socketpair(); print('inet6 and unix ok')";
    let ran = run_py(&[], code);
    assert_eq!(
        ran.stdout,
        "40 EPERM\n17 EPERM\n16 EPERM\n15 EPERM\n21 EPERM\n29 EPERM\n30 EPERM\n31 EPERM\n38 EPERM\n44 EPERM\nroute netlink ok\ninet6 and unix ok\n",
        "{ran:?}"
    );
}

/// Terminals come from one pool of the kernel's for every devpts but the host's own (4096
/// less 1024 kept for the host): one process of a cell opened all 3,071 of them, and no other
/// cell could open a terminal (`warden exec --tty` among them) until it ended. A cell's devpts
/// holds at most 128.
#[test]
fn a_cell_cannot_take_the_terminals_of_other_cells() {
    let name = unique("ptys");
    let code = "import os, time\n\
                fds = []\n\
                while len(fds) < 4096:\n\
                \x20   try: fds.append(os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY))\n\
                \x20   except OSError: break\n\
                print(len(fds), flush=True)\n\
                time.sleep(30)\n";
    let hog = Holding::start(&name, "40s", code);
    // While the first cell holds every terminal it could get, another cell opens one.
    let other = run_py(
        &[],
        "import os\n\
         try: os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY); print('opened')\n\
         except OSError as e: print(os.strerror(e.errno))",
    );
    let held: usize = hog.first_line.trim().parse().unwrap();
    drop(hog);
    assert!(held > 0 && held <= 128, "a cell held {held} terminals");
    assert_eq!(
        other.stdout.trim(),
        "opened",
        "another cell could not open a terminal while one held {held}: {other:?}"
    );
}

/// Huge pages come from the host's reserved pool, which no memory limit counts (a cell could
/// take every page the host keeps for its databases); a terminal's line discipline other than
/// the plain one is a protocol of the kernel's (HDLC, GSM, SLIP, ...) whose first use loads a
/// module on many hosts; `open_tree_attr` is the mount API's newest call. Each is refused
/// before the kernel looks at its arguments (`EPERM` where the kernel answers `ENOMEM`,
/// `EINVAL` or nothing; a line discipline can be read, not set, since the filter cannot see
/// which one is asked for), and the plain forms still work.
#[test]
fn huge_pages_line_disciplines_and_open_tree_attr_are_refused() {
    let code = "import ctypes, errno, fcntl, os, pty, struct, termios\n\
                libc = ctypes.CDLL(None, use_errno=True)\n\
                libc.mmap.restype = ctypes.c_long\n\
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n\
                def show(name, r):\n\
                \x20   print(name, errno.errorcode[ctypes.get_errno()] if r == -1 else 'allowed')\n\
                show('mmap', libc.mmap(None, 2 << 20, 3, 0x22 | 0x40000, -1, 0))\n\
                show('memfd_create', libc.memfd_create(b'h', 4))\n\
                show('shmget', libc.shmget(0, 2 << 20, 0o1000 | 0o4000 | 0o600))\n\
                show('open_tree_attr', libc.syscall(467, -100, b'/', 0x40000000, None, 0))\n\
                m, s = pty.openpty()\n\
                try: fcntl.ioctl(s, termios.TIOCSETD, struct.pack('i', 27)); print('TIOCSETD allowed')\n\
                except OSError as e: print('TIOCSETD', errno.errorcode[e.errno])\n\
                fcntl.ioctl(s, termios.TIOCGETD, struct.pack('i', 0))\n\
                show('plain', min(libc.mmap(None, 4096, 3, 0x22, -1, 0), libc.memfd_create(b'p', 0), libc.shmget(0, 4096, 0o1000 | 0o600)))\n";
    let ran = run_py(&[], code);
    assert_eq!(
        ran.stdout,
        "mmap EPERM\nmemfd_create EPERM\nshmget EPERM\nopen_tree_attr EPERM\nTIOCSETD EPERM\nplain allowed\n",
        "{ran:?}"
    );
}

#[test]
fn caller_environment_and_inherited_fds_do_not_reach_the_cell() {
    let dir = tempdir();
    let secret = dir.path().join("fd-secret");
    std::fs::write(&secret, "FD-SECRET-99").unwrap();
    // The shell opens fd 7 without close-on-exec and exports a secret, then execs warden.
    let script = format!(
        "exec 7<{} 8>&1; export API_KEY=ENV-SECRET-42; exec {BIN} run -- sh -c \
         'env; ls /proc/self/fd | tr \"\\n\" \" \"; echo; cat <&7 2>&1 || echo no-fd7'",
        secret.display()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(
        !ran.stdout.contains("ENV-SECRET-42") && !ran.stdout.contains("API_KEY"),
        "{ran:?}"
    );
    assert!(!ran.stdout.contains("FD-SECRET-99"), "{ran:?}");
    assert!(ran.stdout.contains("no-fd7"), "{ran:?}");
    let fds_line = ran.stdout.lines().find(|l| l.starts_with("0 ")).unwrap();
    assert_eq!(
        fds_line.trim(),
        "0 1 2 3",
        "only stdio (and ls's own directory fd) may be open"
    );
}

#[test]
fn the_command_runs_unprivileged_with_no_capabilities() {
    let ran = run_sh(
        &[],
        "id -u; grep -E '^(CapEff|CapBnd|CapPrm|NoNewPrivs|Seccomp):' /proc/self/status; cat /proc/self/uid_map",
    );
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines[0], "1000", "{ran:?}");
    assert!(ran.stdout.contains("CapEff:\t0000000000000000"), "{ran:?}");
    assert!(ran.stdout.contains("CapBnd:\t0000000000000000"), "{ran:?}");
    assert!(ran.stdout.contains("NoNewPrivs:\t1"), "{ran:?}");
    assert!(ran.stdout.contains("Seccomp:\t2"), "{ran:?}");
    // No inside id maps to host root: the uid map is the last output, one range per line.
    let map: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| !l.contains(':'))
        .skip(1)
        .collect();
    assert!(!map.is_empty(), "{ran:?}");
    for line in map {
        let fields: Vec<u64> = line
            .split_whitespace()
            .map(|f| f.parse().unwrap())
            .collect();
        assert_eq!(fields.len(), 3, "{line}");
        assert!(fields[1] > 0, "an inside id maps to host root: {line}");
    }
}

#[test]
fn setuid_bits_cannot_be_set() {
    let ws = tempdir();
    let ran = run_sh(
        &[
            "--policy",
            &direct_policy(),
            "--workspace",
            ws.path().to_str().unwrap(),
        ],
        "cp /bin/true /workspace/t && chmod u+s /workspace/t 2>&1; chmod g+s /workspace 2>&1; stat -c %A /workspace/t",
    );
    assert!(ran.stdout.contains("Operation not permitted"), "{ran:?}");
    let mode = std::fs::metadata(ws.path().join("t"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o6000, 0, "setuid bit reached the host");
}

#[test]
fn protected_workspace_paths_are_read_only() {
    let ws = tempdir();
    std::fs::create_dir_all(ws.path().join(".git/hooks")).unwrap();
    std::fs::write(ws.path().join(".envrc"), "export A=1\n").unwrap();
    let ran = run_sh(
        &[
            "--policy",
            &direct_policy(),
            "--workspace",
            ws.path().to_str().unwrap(),
        ],
        "echo evil > /workspace/.git/hooks/pre-commit 2>&1; echo evil >> /workspace/.envrc 2>&1; \
         rm -f /workspace/.envrc 2>&1; echo fine > /workspace/src.txt && echo done",
    );
    assert!(ran.stdout.contains("done"), "{ran:?}");
    assert!(!ws.path().join(".git/hooks/pre-commit").exists());
    assert_eq!(
        std::fs::read_to_string(ws.path().join(".envrc")).unwrap(),
        "export A=1\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("src.txt")).unwrap(),
        "fine\n"
    );
}

#[test]
fn abstract_unix_sockets_of_the_host_are_out_of_reach() {
    // An abstract socket listening on the host; the cell has its own network namespace and a
    // Landlock scope, so connecting must fail.
    let name = unique("warden-abstract");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    listener.set_nonblocking(true).unwrap();
    let code = format!(
        "import socket, errno\n\
         s = socket.socket(socket.AF_UNIX)\n\
         try:\n    s.connect('\\0{name}'); print('connected')\n\
         except OSError as e: print('errno', errno.errorcode[e.errno])"
    );
    let ran = run_py(&[], &code);
    assert!(ran.stdout.starts_with("errno "), "{ran:?}");
    let mut buf = [0u8; 1];
    assert!(
        listener
            .accept()
            .map(|(mut s, _)| s.read(&mut buf))
            .is_err()
    );
}

#[test]
fn x32_syscalls_and_unfilterable_clone3_are_refused() {
    // getpid through the x32 ABI (bit 30 set) must not slip past the filter; clone3 and openat2
    // answer ENOSYS so that libc falls back to calls whose flags the filter can read.
    let code = errno_of("", "libc.syscall(0x40000000 | 39)")
        + "\nr = libc.syscall(435, 0, 0); print('clone3', errno.errorcode.get(ctypes.get_errno()) if r == -1 else 'OK')"
        + "\nr = libc.syscall(437, -100, b'/etc/passwd', 0, 0); print('openat2', errno.errorcode.get(ctypes.get_errno()) if r == -1 else 'OK')"
        + "\nimport subprocess; print(subprocess.run(['true']).returncode)";
    let ran = run_py(&[], &code);
    assert_eq!(
        ran.stdout, "errno EPERM\nclone3 ENOSYS\nopenat2 ENOSYS\n0\n",
        "{ran:?}"
    );
}

#[test]
fn the_policy_sets_user_host_name_environment_and_hidden_paths() {
    let dir = tempdir();
    let file = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  hidden: [/usr/share/doc]\nprocess:\n  user: 1234\n  group: 4321\n  hostname: sandbox-7\n  env:\n    set: { PATH: /usr/bin:/bin, GREETING: hello }\n    pass: []\n",
    );
    let ran = run_sh(
        &["--policy", file.to_str().unwrap()],
        "id -u; id -g; hostname; echo $GREETING; ls /usr/share/doc | wc -l; touch /usr/share/doc/x 2>&1 | tail -c 22",
    );
    assert_eq!(
        ran.stdout, "1234\n4321\nsandbox-7\nhello\n0\nRead-only file system\n",
        "{ran:?}"
    );
    // The host still has the directory and its content.
    assert!(std::fs::read_dir("/usr/share/doc").unwrap().count() > 0);
}
