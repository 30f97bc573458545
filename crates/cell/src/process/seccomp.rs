//! The seccomp filter of the process tier: a deny list of the kernel surface a cell never needs
//! and that has a history of escapes. Everything refused returns EPERM (ENOSYS for `clone3` and
//! `openat2`, so that libc falls back to calls whose flags the filter can inspect).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op,
    SeccompCondition as Cond, SeccompFilter, SeccompRule, TargetArch, sock_filter,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the seccomp filter failed: {0}")]
    Build(String),
}

/// System calls refused outright.
const DENIED: &[i64] = &[
    // The mount API: a cell's file system view is fixed by the warden.
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    SYS_OPEN_TREE_ATTR,
    // Looking into or steering other processes.
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kcmp,
    libc::SYS_pidfd_getfd,
    // Kernel attack surface with a history of escapes.
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_userfaultfd,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    // Changing the machine.
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_vhangup,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_settimeofday,
    libc::SYS_adjtimex,
    // Namespaces: a cell cannot enter others.
    libc::SYS_setns,
    // File handles bypass path-based checks.
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    // Personality flags re-enable legacy behaviours (READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE).
    libc::SYS_personality,
];

const TIOCSTI: u64 = 0x5412;
/// Sharing extents between files (reflinks and deduplication): on a btrfs disk a cell could make
/// files whose data is far larger than its disk, which a copy out of the disk (a snapshot past
/// half of it, a removal that moves snapshots out) would then write in full on the host.
const FICLONE: u64 = 0x4004_9409;
const FICLONERANGE: u64 = 0x4020_940d;
const FIDEDUPERANGE: u64 = 0xc018_9436;
const TIOCLINUX: u64 = 0x541C;
/// Setting a terminal's line discipline: any but the plain one is a protocol of the kernel's
/// (HDLC, GSM, SLIP, ...) that a cell has no use for, whose first use loads a module on many
/// hosts, as a socket family's does.
const TIOCSETD: u64 = 0x5423;
/// `open_tree` and `mount_setattr` in one call (Linux 6.15), which the libc crate does not name.
const SYS_OPEN_TREE_ATTR: i64 = 467;
/// Huge pages (`mmap`, `memfd_create`, `shmget`) come from the host's reserved pool, which no
/// memory limit counts: a cell could take every page the host keeps for its own programs.
const MAP_HUGETLB: u64 = libc::MAP_HUGETLB as u64;
const MFD_HUGETLB: u64 = libc::MFD_HUGETLB as u64;
const SHM_HUGETLB: u64 = libc::SHM_HUGETLB as u64;
const AF_UNIX: u64 = 1;
const AF_INET: u64 = 2;
const AF_INET6: u64 = 10;
const AF_NETLINK: u64 = 16;
/// The socket families a cell may open (netlink for routes alone, below).
const ALLOWED_FAMILIES: [u64; 4] = [AF_UNIX, AF_INET, AF_INET6, AF_NETLINK];
#[cfg(test)]
const AF_PACKET: u64 = 17;
#[cfg(test)]
const AF_VSOCK: u64 = 40;
const NETLINK_ROUTE: u64 = 0;
const CLONE_NEWUSER: u64 = libc::CLONE_NEWUSER as u64;
const PER_LINUX: u64 = 0;
const SETUID: u64 = libc::S_ISUID as u64;
const SETGID: u64 = libc::S_ISGID as u64;
const FCHMODAT2: i64 = 452;
const QUERY_PERSONALITY: u64 = 0xffff_ffff;

fn cond(arg: u8, len: Len, op: Op, value: u64) -> Result<Cond, SeccompError> {
    Cond::new(arg, len, op, value).map_err(|e| SeccompError::Build(e.to_string()))
}

fn rule(conditions: Vec<Cond>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conditions).map_err(|e| SeccompError::Build(e.to_string()))
}

/// Builds the main filter: refused calls return EPERM, everything else is allowed.
pub fn deny_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in DENIED {
        rules.insert(*nr, Vec::new());
    }
    // personality(): allow only querying and the plain Linux personality.
    rules.remove(&libc::SYS_personality);
    rules.insert(
        libc::SYS_personality,
        vec![rule(vec![
            cond(0, Len::Dword, Op::Ne, PER_LINUX)?,
            cond(0, Len::Dword, Op::Ne, QUERY_PERSONALITY)?,
        ])?],
    );
    // New user namespaces: the one namespace an unprivileged process could still create.
    let newuser = || cond(0, Len::Qword, Op::MaskedEq(CLONE_NEWUSER), CLONE_NEWUSER);
    rules.insert(libc::SYS_unshare, vec![rule(vec![newuser()?])?]);
    rules.insert(libc::SYS_clone, vec![rule(vec![newuser()?])?]);
    // Typing into a terminal (TIOCSTI), driving the console (TIOCLINUX), a terminal's line
    // discipline (TIOCSETD).
    rules.insert(
        libc::SYS_ioctl,
        vec![
            rule(vec![cond(1, Len::Dword, Op::Eq, TIOCSTI)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, TIOCLINUX)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, TIOCSETD)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, FICLONE)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, FICLONERANGE)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, FIDEDUPERANGE)?])?,
        ],
    );
    // Sockets: the families a cell's programs use, and no other. Every other family reaches
    // past the network namespace (vsock, packet) or into a protocol of the kernel's that a cell
    // has no use for and that its first socket would load as a module on many hosts (CAN, RDS,
    // TIPC, ...: the home of many of the kernel's past holes). Netlink for routes only (what
    // `getifaddrs` and `ip` read).
    let family = |value| cond(0, Len::Dword, Op::Eq, value);
    let not_family = |value| cond(0, Len::Dword, Op::Ne, value);
    let socket_rules = vec![
        rule(
            ALLOWED_FAMILIES
                .iter()
                .map(|f| not_family(*f))
                .collect::<Result<_, _>>()?,
        )?,
        rule(vec![
            family(AF_NETLINK)?,
            cond(2, Len::Dword, Op::Ne, NETLINK_ROUTE)?,
        ])?,
    ];
    rules.insert(libc::SYS_socket, socket_rules.clone());
    rules.insert(libc::SYS_socketpair, socket_rules);

    // Huge pages from the host's reserved pool.
    let flag = |arg: u8, bit: u64| -> Result<Vec<SeccompRule>, SeccompError> {
        Ok(vec![rule(vec![cond(
            arg,
            Len::Dword,
            Op::MaskedEq(bit),
            bit,
        )?])?])
    };
    rules.insert(libc::SYS_mmap, flag(3, MAP_HUGETLB)?);
    rules.insert(libc::SYS_memfd_create, flag(1, MFD_HUGETLB)?);
    rules.insert(libc::SYS_shmget, flag(2, SHM_HUGETLB)?);

    // Setuid and setgid bits: a file the cell creates in a host directory must never become a
    // way for host users to gain the owner's rights.
    let special_bit = |arg: u8, bit: u64| cond(arg, Len::Dword, Op::MaskedEq(bit), bit);
    let mode_rules = |arg: u8| -> Result<Vec<SeccompRule>, SeccompError> {
        Ok(vec![
            rule(vec![special_bit(arg, SETUID)?])?,
            rule(vec![special_bit(arg, SETGID)?])?,
        ])
    };
    rules.insert(libc::SYS_chmod, mode_rules(1)?);
    rules.insert(libc::SYS_fchmod, mode_rules(1)?);
    rules.insert(libc::SYS_fchmodat, mode_rules(2)?);
    rules.insert(FCHMODAT2, mode_rules(2)?);
    rules.insert(libc::SYS_creat, mode_rules(1)?);
    rules.insert(libc::SYS_open, mode_rules(2)?);
    rules.insert(libc::SYS_openat, mode_rules(3)?);
    rules.insert(libc::SYS_mknod, mode_rules(1)?);
    rules.insert(libc::SYS_mknodat, mode_rules(2)?);

    let ruled: Vec<u32> = rules.keys().map(|nr| *nr as u32).collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| SeccompError::Build(e.to_string()))?;
    let compiled: BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))?;
    // seccompiler's program is [architecture check (3 instructions), rest]; the rest reloads the
    // syscall number itself, so the prelude and the dispatch can go between them without moving
    // any jump target.
    let (arch_check, rest) = compiled.split_at(ARCH_CHECK_LEN);
    let mut program = arch_check.to_vec();
    program.extend(prelude());
    program.extend(dispatch(&ruled)?);
    program.extend_from_slice(rest);
    Ok(program)
}

/// A binary search over the system calls that have rules (`ruled`: sorted, each once, as the
/// rules' map gives them), with the number
/// still loaded by the prelude: one of them goes on to seccompiler's rules, which follow; any
/// other is allowed at once, as the rules would allow it (their default action). seccompiler's
/// rules test the numbers one after the other, so every allowed call walked all of them: the
/// kernel, which works out when a filter is loaded which calls it allows whatever their
/// arguments (emulating it once per system call number), took 0.2 ms to load the filter
/// (a chain of 450 comparisons alone takes 1 ms), and each call whose arguments it looks at
/// walked the chain again.
fn dispatch(ruled: &[u32]) -> Result<Vec<sock_filter>, SeccompError> {
    #[derive(Clone, Copy)]
    enum To {
        Node(usize),
        Allow,
        Rules,
    }
    // (code, k, where it jumps when true, when false); a jump goes forward only, so a split
    // comes before both halves: its lower half follows it.
    fn build(values: &[u32], nodes: &mut Vec<(u16, u32, To, To)>) {
        match values {
            [] => {}
            [only] => nodes.push((BPF_JMP_JEQ_K, *only, To::Rules, To::Allow)),
            _ => {
                let (low, high) = values.split_at(values.len() / 2);
                let at = nodes.len();
                nodes.push((BPF_JMP_JGE_K, high[0], To::Allow, To::Allow));
                build(low, nodes);
                let high_at = nodes.len();
                build(high, nodes);
                nodes[at].2 = To::Node(high_at);
                nodes[at].3 = To::Node(at + 1);
            }
        }
    }
    let mut nodes = Vec::new();
    build(ruled, &mut nodes);
    let allow = nodes.len();
    let offset = |from: usize, to: To| -> Result<u8, SeccompError> {
        let target = match to {
            To::Node(i) => i,
            To::Allow => allow,
            To::Rules => allow + 1,
        };
        u8::try_from(target - from - 1)
            .map_err(|_| SeccompError::Build("the system call dispatch is too long".to_owned()))
    };
    let mut out = Vec::with_capacity(nodes.len() + 1);
    for (i, (code, k, yes, no)) in nodes.iter().enumerate() {
        out.push(sock_filter {
            code: *code,
            jt: offset(i, *yes)?,
            jf: offset(i, *no)?,
            k: *k,
        });
    }
    out.push(sock_filter {
        code: BPF_RET_K,
        jt: 0,
        jf: 0,
        k: libc::SECCOMP_RET_ALLOW,
    });
    Ok(out)
}

const ARCH_CHECK_LEN: usize = 3;

// The classic BPF instructions the prelude and the dispatch are written in.
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;

/// Checks that run before the per-syscall rules: refuse x32 system calls (numbers with bit 30
/// set share the x86_64 audit architecture and would otherwise slip past a deny list), and make
/// `clone3` and `openat2` fail with ENOSYS: both pass their flags in memory a filter cannot read,
/// and libc then falls back to `clone` and `openat`, whose arguments the rules check. So does
/// `copy_file_range` (programs then read and write), which on a btrfs disk shares extents.
fn prelude() -> Vec<sock_filter> {
    const SECCOMP_DATA_NR: u32 = 0;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let stmt = |code, k| sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code, k, jt, jf| sock_filter { code, jt, jf, k };
    vec![
        stmt(BPF_LD_W_ABS, SECCOMP_DATA_NR),
        jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        jump(BPF_JMP_JEQ_K, libc::SYS_clone3 as u32, 2, 0),
        jump(BPF_JMP_JEQ_K, libc::SYS_openat2 as u32, 1, 0),
        jump(BPF_JMP_JEQ_K, libc::SYS_copy_file_range as u32, 0, 1),
        stmt(BPF_RET_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prelude_sits_between_the_arch_check_and_the_rules() {
        let program = deny_filter().unwrap();
        assert!(program.len() > DENIED.len());
        // The arch check's success jump lands on the prelude's first instruction.
        assert_eq!(program[1].jt, 1);
        assert_eq!(
            program[ARCH_CHECK_LEN..ARCH_CHECK_LEN + prelude().len()],
            prelude()[..]
        );
        // The rules, after the dispatch, start by loading the syscall number again.
        assert_eq!(program[rules_at(&program)], program[ARCH_CHECK_LEN]);
    }

    /// Where seccompiler's rules start in the filter: after the dispatch's closing allow.
    fn rules_at(program: &[sock_filter]) -> usize {
        let dispatch_at = ARCH_CHECK_LEN + prelude().len();
        let allow = program[dispatch_at..]
            .iter()
            .position(|i| i.code == BPF_RET_K && i.k == libc::SECCOMP_RET_ALLOW)
            .expect("the dispatch ends with its allow");
        dispatch_at + allow + 1
    }

    /// The seccompiler program the filter is made of, before the prelude and the dispatch.
    #[test]
    fn sockets_of_the_allowed_families_alone_open() {
        let filter = deny_filter().unwrap();
        for nr in [libc::SYS_socket, libc::SYS_socketpair] {
            for family in 0..64u64 {
                for protocol in [0u64, 9] {
                    let allowed = matches!(family, AF_UNIX | AF_INET | AF_INET6)
                        || (family == AF_NETLINK && protocol == NETLINK_ROUTE);
                    let got = run(&filter, nr as u32, [family, 1, protocol, 0, 0, 0]);
                    assert_eq!(
                        got == libc::SECCOMP_RET_ALLOW,
                        allowed,
                        "system call {nr}, family {family}, protocol {protocol}"
                    );
                }
            }
        }
    }

    fn without_dispatch() -> BpfProgram {
        let full = deny_filter().unwrap();
        let mut program = full[..ARCH_CHECK_LEN + prelude().len()].to_vec();
        program.extend_from_slice(&full[rules_at(&full)..]);
        program
    }

    /// Runs a classic BPF program on a `seccomp_data` of x86_64 (the instructions these
    /// programs use; any other fails the test).
    fn run(program: &[sock_filter], nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&nr.to_ne_bytes());
        data.extend_from_slice(&0xc000_003e_u32.to_ne_bytes()); // AUDIT_ARCH_X86_64
        data.extend_from_slice(&0u64.to_ne_bytes());
        for arg in args {
            data.extend_from_slice(&arg.to_ne_bytes());
        }
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let i = &program[pc];
            let jump = |taken: bool| pc + 1 + usize::from(if taken { i.jt } else { i.jf });
            pc = match i.code {
                0x20 => {
                    let at = i.k as usize;
                    a = u32::from_ne_bytes(data[at..at + 4].try_into().unwrap());
                    pc + 1
                }
                0x54 => {
                    a &= i.k;
                    pc + 1
                }
                0x05 => pc + 1 + i.k as usize,
                0x15 => jump(a == i.k),
                0x25 => jump(a > i.k),
                0x35 => jump(a >= i.k),
                0x45 => jump(a & i.k != 0),
                0x06 => return i.k,
                code => panic!("instruction {code:#x} is not interpreted here"),
            };
        }
    }

    /// The dispatch changes no decision: for every system call number (and x32 ones), with
    /// arguments that trip each rule and random ones, the filter answers as seccompiler's
    /// program with the prelude alone does.
    #[test]
    fn the_dispatch_decides_as_the_rules_alone() {
        let with = deny_filter().unwrap();
        let without = without_dispatch();
        assert!(with.len() > without.len());
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut random = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let special: [u64; 18] = [
            0,
            u64::MAX,
            AF_UNIX,
            AF_INET6,
            TIOCSTI,
            TIOCLINUX,
            TIOCSETD,
            MAP_HUGETLB | 0x22,
            MFD_HUGETLB,
            SHM_HUGETLB,
            FICLONE,
            AF_NETLINK,
            AF_PACKET,
            AF_VSOCK,
            CLONE_NEWUSER,
            SETUID | 0o755,
            SETGID,
            QUERY_PERSONALITY,
        ];
        let numbers = (0..=470u32).chain([0x4000_0000, 0x4000_0001, 0x4000_0101]);
        let mut refused = 0;
        for nr in numbers {
            let mut cases: Vec<[u64; 6]> = special.iter().map(|v| [*v; 6]).collect();
            for position in 0..4 {
                for value in special {
                    let mut args = [0u64; 6];
                    args[position] = value;
                    cases.push(args);
                }
            }
            cases.extend((0..20).map(|_| [(); 6].map(|()| random())));
            for args in cases {
                let (a, b) = (run(&with, nr, args), run(&without, nr, args));
                assert_eq!(a, b, "system call {nr} with {args:x?}");
                refused += usize::from(a != libc::SECCOMP_RET_ALLOW);
            }
        }
        // The cases reach the refusals, not only the allowed calls.
        assert!(refused > 500, "{refused}");
    }
}
