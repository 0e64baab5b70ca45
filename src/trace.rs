//! handoff's `tracing` events and spans (feature `tracing`). Call sites use these macros, which
//! take `tracing`'s own syntax and expand to nothing without the feature: no `tracing` code is
//! compiled then, and an argument is evaluated only with it.

/// An event at `$level` (`error`, `warn`, `info`, `debug`, `trace`), in `tracing`'s syntax.
#[cfg(feature = "tracing")]
macro_rules! event {
    ($level:ident, $($arg:tt)*) => {
        ::tracing::$level!($($arg)*)
    };
}

#[cfg(not(feature = "tracing"))]
macro_rules! event {
    ($($arg:tt)*) => {};
}

/// A span at `$level`, entered until the value it returns is dropped (`()` without the feature).
#[cfg(feature = "tracing")]
macro_rules! entered {
    ($level:ident, $($arg:tt)*) => {
        ::tracing::span!(::tracing::Level::$level, $($arg)*).entered()
    };
}

#[cfg(not(feature = "tracing"))]
macro_rules! entered {
    ($($arg:tt)*) => {
        ()
    };
}

/// Statements run only with the feature: for an event whose fields need a computation.
#[cfg(feature = "tracing")]
macro_rules! with_tracing {
    ($($body:tt)*) => {
        { $($body)* }
    };
}

#[cfg(not(feature = "tracing"))]
macro_rules! with_tracing {
    ($($body:tt)*) => {};
}

pub(crate) use {entered, event, with_tracing};
