//! The CUDA half: devices, streams and events, device buffers and their views, pinned host
//! memory, modules and kernel launches, and graphs. Every operation that queues work goes through
//! the engine (`src/engine`), which tracks the buffers it uses.

pub mod buffer;
pub mod completion;
pub mod device;
pub mod graph;
pub mod host;
pub mod module;
pub mod stream;
pub mod view;

pub use buffer::DeviceBuffer;
pub use completion::{EventCompletion, StreamCompletion};
pub use device::Device;
pub use graph::Graph;
pub use host::{HostBuffer, HostRead};
pub use module::{ByValue, Function, KernelArg, LaunchBuilder, LaunchConfig, Module};
pub use stream::{Event, RawUse, Stream};
pub use view::{View, ViewMut};
