//! [`CommOptions`]: how a communicator is made. Verification is on by default in every
//! profile, and only the `unsafe` [`CommOptions::unverified`] turns it off.

use std::time::Duration;

use crate::result::nccl as nc;

/// How a communicator is made: built from [`CommOptions::default`] with the `with_*` methods.
///
/// ```
/// use std::time::Duration;
/// let options = handoff::CommOptions::default().with_timeout(Duration::from_secs(30));
/// assert!(options.verified() && options.blocking());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommOptions {
    timeout: Duration,
    blocking: bool,
    verified: bool,
    cta_policy: Option<CtaPolicy>,
}

/// NCCL's CTA policy (`ncclConfig_t::CTAPolicy`): how many thread blocks (CTAs) its
/// collectives may take from the GPU.
///
/// The environment variable `NCCL_CTA_POLICY` overrides it (NCCL 2.28 reads the variable after
/// the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtaPolicy {
    /// NCCL's default (`NCCL_CTA_POLICY_DEFAULT`): CTAs for bandwidth.
    Default,
    /// Fewer CTAs where registered buffers let NCCL keep the bandwidth
    /// (`NCCL_CTA_POLICY_EFFICIENCY`).
    Efficiency,
    /// No CTAs where NCCL can avoid them (`NCCL_CTA_POLICY_ZERO`): on NCCL 2.28, all-gather,
    /// all-to-all, gather and scatter whose send and receive buffers both lie in symmetric
    /// windows ([`Communicator::register_window`](crate::Communicator::register_window)), on a
    /// communicator of one node, of more than one rank, whose GPUs all reach each other directly,
    /// run on the copy engines (driver 12.5 or newer). Other collectives run as usual.
    Zero,
}

impl CtaPolicy {
    pub(crate) fn code(self) -> i32 {
        use crate::sys::nccl as n;
        let code = match self {
            CtaPolicy::Default => n::NCCL_CTA_POLICY_DEFAULT,
            CtaPolicy::Efficiency => n::NCCL_CTA_POLICY_EFFICIENCY,
            CtaPolicy::Zero => n::NCCL_CTA_POLICY_ZERO,
        };
        code as i32
    }
}

impl Default for CommOptions {
    /// Verified, blocking, with a 120 s timeout.
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(120),
            blocking: true,
            verified: true,
            cta_policy: None,
        }
    }
}

impl CommOptions {
    /// Non-blocking, with `timeout` for every host-side wait; otherwise the defaults.
    pub fn nonblocking(timeout: Duration) -> Self {
        CommOptions::default().with_timeout(timeout).with_blocking(false)
    }

    /// The deadline of every wait on the communicator: creation (non-blocking only), a peer's
    /// counterpart during verification, [`Communicator::synchronize`](crate::Communicator::synchronize),
    /// [`Communicator::wait_stream`](crate::Communicator::wait_stream), finalizing, and the
    /// watchdog's deadline for queued work (see [`Communicator`](crate::Communicator)). Past
    /// it the communicator is aborted.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// NCCL's `blocking` setting. Blocking (the default, and NCCL's) is fast: a send or receive
    /// returns after a few microseconds. Non-blocking makes creation and enqueueing time out
    /// instead of hanging on a rank that never comes, but on NCCL 2.28 every group then goes
    /// through NCCL's background thread, which costs tens of microseconds per call
    /// (BENCHMARKS.md).
    pub fn with_blocking(mut self, blocking: bool) -> Self {
        self.blocking = blocking;
        self
    }

    /// Turns verification off: sends and receives go to NCCL without this rank first seeing its
    /// peer's counterpart. Saves the host a few hundred nanoseconds per group (BENCHMARKS.md).
    ///
    /// Every rank of the communicator must be made with the same setting; a rank that differs
    /// gets an error when the communicator is created, on every rank.
    ///
    /// # Safety
    /// For every send this rank posts, the peer posts a receive of the same element count and
    /// type, and the sends and receives between each pair of ranks are posted in the same order
    /// on both (a send to oneself included: its receive in the same group), counting the
    /// per-peer parts of all_to_all, gather and scatter as NCCL does (see
    /// `src/nccl/verify/model.rs`); every rank posts the same collectives in the same order;
    /// and both sides of each transfer agree on whether their memory is registered with the
    /// communicator, and, in a graph capture, on whether it is from `ncclMemAlloc` (what
    /// verification would have compared); a replay of a [`GraphFamily`](crate::GraphFamily)'s
    /// graph posts the operations captured in it, so ranks replay their graphs in an order that
    /// keeps all this true. NCCL leaves a disagreement undefined: on two H200s it
    /// delivers wrong data, hangs, or writes past the end of a shorter receive buffer.
    ///
    /// ```
    /// // SAFETY: every rank of this program posts matching sends and receives.
    /// let options = unsafe { handoff::CommOptions::default().unverified() };
    /// assert!(!options.verified());
    /// ```
    /// Turning verification off is never a safe call, nor a plain field (issue 9, hole 1):
    /// ```compile_fail
    /// let options = handoff::CommOptions::default().unverified();
    /// ```
    pub unsafe fn unverified(mut self) -> Self {
        self.verified = false;
        self
    }

    /// NCCL's CTA policy for the communicator ([`CtaPolicy`]); unset, NCCL chooses
    /// (`NCCL_CTA_POLICY`, else its default).
    ///
    /// ```
    /// use handoff::{CommOptions, CtaPolicy};
    /// let options = CommOptions::default().with_cta_policy(CtaPolicy::Zero);
    /// assert_eq!(options.cta_policy(), Some(CtaPolicy::Zero));
    /// ```
    pub fn with_cta_policy(mut self, policy: CtaPolicy) -> Self {
        self.cta_policy = Some(policy);
        self
    }

    /// The CTA policy ([`CommOptions::with_cta_policy`]), if set.
    pub fn cta_policy(&self) -> Option<CtaPolicy> {
        self.cta_policy
    }

    /// The timeout ([`CommOptions::with_timeout`]).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the communicator is blocking ([`CommOptions::with_blocking`]).
    pub fn blocking(&self) -> bool {
        self.blocking
    }

    /// Whether operations are verified across ranks (the default; see
    /// [`CommOptions::unverified`]).
    pub fn verified(&self) -> bool {
        self.verified
    }

    pub(crate) fn config(&self) -> crate::sys::nccl::ncclConfig_t {
        let mut config = nc::config_initializer();
        config.blocking = i32::from(self.blocking);
        if let Some(p) = self.cta_policy {
            config.CTAPolicy = p.code();
        }
        config
    }
}

pub(crate) const SPLIT_SHARE: &str = "NCCL_COMM_SPLIT_SHARE_RESOURCES";

/// `NCCL_COMM_SPLIT_SHARE_RESOURCES` before handoff's first communicator of this process.
pub(crate) static FIRST_SPLIT_SHARE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Records what NCCL will read at the first communicator: called before each is made.
pub(crate) fn note_nccl_environment() {
    FIRST_SPLIT_SHARE.get_or_init(|| std::env::var(SPLIT_SHARE).ok());
}

/// Whether NCCL, as this process and `options` set it up, may pick NVLS for a merge of a
/// group's collectives by whether one registration covers the merge (see
/// `verify::order::layout_dependent_merge`): NVLS not turned off (`NCCL_NVLS_ENABLE=0`), and
/// the efficiency CTA policy (the options or `NCCL_CTA_POLICY`, which ranks must set alike)
/// or a tuner plugin (`NCCL_TUNER_PLUGIN`, or a plugin library NCCL loaded: NCCL 2.28 looks for
/// a tuner in `libnccl-tuner.so` and in the net plugin). Unknown values count as yes.
pub(crate) fn algorithm_may_follow_layout(options: &CommOptions) -> bool {
    let var = |k: &str| {
        std::env::var(k)
            .ok()
            .map(|v| v.trim().to_ascii_uppercase())
            .filter(|v| !v.is_empty())
    };
    if var("NCCL_NVLS_ENABLE").as_deref() == Some("0") {
        return false;
    }
    let efficiency = options.cta_policy() == Some(CtaPolicy::Efficiency)
        || var("NCCL_CTA_POLICY").is_some_and(|v| !matches!(v.as_str(), "0" | "2" | "DEFAULT" | "ZERO"));
    let tuner = var("NCCL_TUNER_PLUGIN").is_some_and(|v| v != "NONE")
        || var("NCCL_NET_PLUGIN").is_some_and(|v| v != "NONE")
        || ["libnccl-tuner.so", "libnccl-net.so"].into_iter().any(loaded);
    efficiency || tuner
}

/// Whether the shared library `name` is loaded in this process (nothing is loaded to tell).
fn loaded(name: &str) -> bool {
    // glibc's RTLD_NOLOAD: answer only for a library already loaded.
    const RTLD_NOLOAD: std::ffi::c_int = 4;
    // SAFETY: with RTLD_NOLOAD, dlopen loads nothing and runs no initialiser: it only takes a
    // reference to a library already loaded (which the handle's drop gives back) or fails.
    unsafe { libloading::os::unix::Library::open(Some(name), libloading::os::unix::RTLD_LAZY | RTLD_NOLOAD) }
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_efficiency_policy_or_a_tuner_lets_the_layout_choose() {
        // The environment of this test process: no NCCL_* variable of these is set in CI.
        for k in [
            "NCCL_NVLS_ENABLE",
            "NCCL_CTA_POLICY",
            "NCCL_TUNER_PLUGIN",
            "NCCL_NET_PLUGIN",
        ] {
            if std::env::var_os(k).is_some() {
                return;
            }
        }
        assert!(!algorithm_may_follow_layout(&CommOptions::default()));
        assert!(!algorithm_may_follow_layout(
            &CommOptions::default().with_cta_policy(CtaPolicy::Zero)
        ));
        assert!(algorithm_may_follow_layout(
            &CommOptions::default().with_cta_policy(CtaPolicy::Efficiency)
        ));
        assert!(!loaded("libhandoff-no-such-library.so"));
    }

    #[test]
    fn verified_by_default_in_every_profile() {
        // Issue 9, hole 1: release builds default to verified too.
        let o = CommOptions::default();
        assert!(o.verified() && o.blocking());
        assert_eq!(o.timeout(), Duration::from_secs(120));
        assert!(CommOptions::nonblocking(Duration::from_secs(3)).verified());
        // SAFETY: not used to make a communicator.
        assert!(!unsafe { CommOptions::default().unverified() }.verified());
    }

    #[test]
    fn cta_policy_reaches_the_config_and_unset_leaves_nccls_choice() {
        // Unset: NCCL_CONFIG_UNDEF_INT, so that NCCL_CTA_POLICY or NCCL's default decides.
        assert_eq!(CommOptions::default().config().CTAPolicy, i32::MIN);
        for (p, code) in [
            (CtaPolicy::Default, 0),
            (CtaPolicy::Efficiency, 1),
            (CtaPolicy::Zero, 2),
        ] {
            let o = CommOptions::default().with_cta_policy(p);
            assert_eq!(o.cta_policy(), Some(p));
            assert_eq!(o.config().CTAPolicy, code);
            // The other settings are untouched.
            assert_eq!(o.config().blocking, 1);
        }
    }
}
