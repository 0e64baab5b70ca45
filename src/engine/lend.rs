//! Lending memory across a stream to work the engine does not queue itself (cudarc's, through a
//! borrowed view; see `crate::interop`), and taking such work's memory in: what keeps both
//! tracked without blocking the host.
//!
//! While a lend is open, the lent work is queued on the stream at times the engine does not
//! see. Two things must then hold until an event recorded after that work is stored:
//! - no use of the memory on another stream may conflict with it (it has no event yet to wait
//!   for): [`crate::engine::tracking::UseTracker::lent_conflict`] refuses such a use, in the
//!   engine's one path ([`Lent`]);
//! - no graph capture may begin on, or join, the stream: the lent work would be queued into the
//!   graph, untracked, to run at every replay, perhaps after the memory is freed; and the
//!   event or waits that close the lend would be graph nodes, not work that runs now
//!   ([`HeldOff`]).

// Only the cudarc interop lends today.
#![cfg_attr(not(feature = "cudarc"), allow(dead_code))]

use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::engine::{StreamState, Tracked, Work, capture_error, not_capturable};
use crate::error::{Error, Result};

/// The error for a use refused by an open lend.
pub(crate) fn refused(access: Access) -> Error {
    let what = match access {
        Access::Read => "read",
        Access::Write => "written",
    };
    Error::InvalidArgument(format!(
        "the buffer is lent to cudarc on another stream, whose work on it has no event yet, so \
         it cannot be {what} here meanwhile: queue this on the stream it is lent on, or after \
         the lend's closure has returned"
    ))
}

/// Refuses a capture beginning on, or joining, a stream across which a lend is open.
pub(crate) fn check_not_lent(held: &StreamState) -> Result<()> {
    if held.lent > 0 {
        return Err(capture_error(
            "memory is lent to or borrowed from cudarc across this stream: its work there must \
             run now, not in a graph; capture after the lend's closure has returned, or on \
             another stream",
        ));
    }
    Ok(())
}

/// Keeps graph captures off a stream while it lives (see the module's doc): counted in the
/// stream's state, which a capture's beginning and a stream's joining check under the same
/// lock.
pub(crate) struct HeldOff<'s> {
    stream: &'s Stream,
}

impl Stream {
    /// Holds captures off this stream until the guard drops.
    ///
    /// # Errors
    /// [`Error::Capture`] while handoff, or anyone else, is capturing the stream.
    pub(crate) fn hold_off_captures(&self) -> Result<HeldOff<'_>> {
        let mut held = self.order().hold();
        if held.capture.is_some() {
            return Err(not_capturable("lending memory to or borrowing it from cudarc"));
        }
        self.check_not_captured_elsewhere()?;
        held.lent += 1;
        Ok(HeldOff { stream: self })
    }
}

impl Drop for HeldOff<'_> {
    fn drop(&mut self) {
        self.stream.order().hold().lent -= 1;
    }
}

/// An open lend of `tracked`'s memory on a stream, for `access`: ended, with an event recorded
/// after the lent work, by [`Lent::close`] or, on an early return or a panic, by its drop.
pub(crate) struct Lent<'a> {
    stream: &'a Stream,
    tracked: &'a Tracked,
    access: Access,
    id: u64,
    open: bool,
    _held_off: HeldOff<'a>,
}

impl<'a> Lent<'a> {
    /// Opens a lend on `stream`: the stream waits, on the GPU, for the earlier uses an
    /// `access` there conflicts with, as for any use; until the lend ends, uses on other
    /// streams that conflict with it are refused, and no capture begins on the stream.
    ///
    /// # Errors
    /// As a tracked use on `stream` ([`Error::InvalidArgument`] for memory of another device,
    /// or one refused by another open lend; [`Error::Capture`] while the stream is captured);
    /// CUDA errors.
    pub(crate) fn open(stream: &'a Stream, tracked: &'a Tracked, access: Access) -> Result<Lent<'a>> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let held_off = stream.hold_off_captures()?;
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        stream.enqueue_work(&[(tracked, access)], Work::Lend { id, open: true }, |_| Ok(()))?;
        Ok(Lent {
            stream,
            tracked,
            access,
            id,
            open: true,
            _held_off: held_off,
        })
    }

    /// Ends the lend: an event recorded on the stream after the lent work is stored as the
    /// lend's use, which later uses wait for.
    ///
    /// # Errors
    /// CUDA errors; the lend is ended all the same, after the host has waited for the stream.
    pub(crate) fn close(mut self) -> Result<()> {
        self.end()
    }

    fn end(&mut self) -> Result<()> {
        if !std::mem::replace(&mut self.open, false) {
            return Ok(());
        }
        let closed = self.stream.enqueue_work(
            &[(self.tracked, self.access)],
            Work::Lend {
                id: self.id,
                open: false,
            },
            |_| Ok(()),
        );
        if closed.is_err() {
            // No event covers the lent work: the host waits for it, after which it needs none.
            // A wait that fails leaves the device in CUDA's sticky error state, where no further
            // work runs.
            let _ = self.stream.synchronize_raw();
            self.tracked.lock().end_lend(self.id);
        }
        closed
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let _ = self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::CaptureState;
    use crate::engine::device::Device;

    #[test]
    fn captures_are_held_off_a_stream_while_a_lend_is_open_across_it() {
        let d = Device::for_tests();
        let s = Stream::for_tests(&d);
        let first = s.hold_off_captures().expect("not captured");
        let second = s.hold_off_captures().expect("lends nest");
        drop(first);
        assert!(matches!(
            check_not_lent(&s.order().hold()),
            Err(Error::Capture { .. })
        ));
        drop(second);
        assert!(check_not_lent(&s.order().hold()).is_ok());
        // And no lend opens across a stream being captured.
        s.order().hold().capture = Some(CaptureState::default());
        assert!(matches!(s.hold_off_captures(), Err(Error::Capture { .. })));
        assert_eq!(s.order().hold().lent, 0);
        s.order().hold().capture = None;
    }
}
