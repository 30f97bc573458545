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
const AF_NETLINK: u64 = 16;
const AF_PACKET: u64 = 17;
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
    // Typing into a terminal (TIOCSTI) or driving the console (TIOCLINUX).
    rules.insert(
        libc::SYS_ioctl,
        vec![
            rule(vec![cond(1, Len::Dword, Op::Eq, TIOCSTI)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, TIOCLINUX)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, FICLONE)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, FICLONERANGE)?])?,
            rule(vec![cond(1, Len::Dword, Op::Eq, FIDEDUPERANGE)?])?,
        ],
    );
    // Sockets that reach past the network namespace or the host's kernel internals.
    let family = |value| cond(0, Len::Dword, Op::Eq, value);
    let socket_rules = vec![
        rule(vec![family(AF_VSOCK)?])?,
        rule(vec![family(AF_PACKET)?])?,
        rule(vec![
            family(AF_NETLINK)?,
            cond(2, Len::Dword, Op::Ne, NETLINK_ROUTE)?,
        ])?,
    ];
    rules.insert(libc::SYS_socket, socket_rules.clone());
    rules.insert(libc::SYS_socketpair, socket_rules);

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
    // syscall number itself, so the prelude can go between them without moving any jump target.
    let (arch_check, rest) = compiled.split_at(ARCH_CHECK_LEN);
    let mut program = arch_check.to_vec();
    program.extend(prelude());
    program.extend_from_slice(rest);
    Ok(program)
}

const ARCH_CHECK_LEN: usize = 3;

/// Checks that run before the per-syscall rules: refuse x32 system calls (numbers with bit 30
/// set share the x86_64 audit architecture and would otherwise slip past a deny list), and make
/// `clone3` and `openat2` fail with ENOSYS: both pass their flags in memory a filter cannot read,
/// and libc then falls back to `clone` and `openat`, whose arguments the rules check. So does
/// `copy_file_range` (programs then read and write), which on a btrfs disk shares extents.
fn prelude() -> Vec<sock_filter> {
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JMP_JEQ_K: u16 = 0x15;
    const BPF_JMP_JGE_K: u16 = 0x35;
    const BPF_RET_K: u16 = 0x06;
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
        // The rules start by loading the syscall number again.
        assert_eq!(
            program[ARCH_CHECK_LEN + prelude().len()],
            program[ARCH_CHECK_LEN]
        );
    }
}
