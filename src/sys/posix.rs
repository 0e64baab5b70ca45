//! The few Linux constants and calls the crate needs beyond the standard library (libc is not
//! a dependency): opening files a peer or the environment names without following links or
//! blocking, and the effective user id.

// The generic values, which Arm and PowerPC change for O_NOFOLLOW; the mailbox's symlink and
// FIFO tests show the flags take effect.
/// Fail with ELOOP rather than follow a symbolic link in the last component.
#[cfg(any(
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "powerpc",
    target_arch = "powerpc64"
))]
pub(crate) const O_NOFOLLOW: i32 = 0o100_000;
#[cfg(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "riscv64",
    target_arch = "loongarch64",
    target_arch = "s390x"
))]
pub(crate) const O_NOFOLLOW: i32 = 0o400_000;
/// Return at once from opening a FIFO with no writer, instead of waiting for one.
pub(crate) const O_NONBLOCK: i32 = 0o4_000;
/// Opening a terminal does not make it the controlling one.
pub(crate) const O_NOCTTY: i32 = 0o400;
/// What open(2) returns for a symbolic link under O_NOFOLLOW.
pub(crate) const ELOOP: i32 = 40;

unsafe extern "C" {
    /// POSIX `geteuid`: the effective user id. No arguments, no preconditions, never fails
    /// (`uid_t` is 32 bits on Linux), so it is declared safe to call.
    pub(crate) safe fn geteuid() -> u32;
}
