//! Short lists kept inline (no heap allocation) up to a few items: the hot path's lists of
//! streams, buffers, uses, guards and events, usually one to four long.

/// A short list of `Copy` items, inline (no heap allocation) up to `N`, on the heap beyond:
/// the hot path's lists of streams, buffers and uses, usually one to four long.
#[derive(Clone)]
pub(crate) enum Few<T: Copy, const N: usize> {
    /// Nothing yet.
    Empty,
    /// The first `len` items; the rest are copies of the first, never read.
    Inline([T; N], usize),
    /// More than `N`.
    Heap(Vec<T>),
}

impl<T: Copy, const N: usize> Few<T, N> {
    pub(crate) fn push(&mut self, t: T) {
        match self {
            Few::Empty => *self = Few::Inline([t; N], 1),
            Few::Inline(items, len) if *len < N => {
                items[*len] = t;
                *len += 1;
            }
            Few::Inline(items, _) => {
                let mut v = Vec::with_capacity(2 * N);
                v.extend_from_slice(items);
                v.push(t);
                *self = Few::Heap(v);
            }
            Few::Heap(v) => v.push(t),
        }
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Few::Empty => &[],
            Few::Inline(items, len) => &items[..*len],
            Few::Heap(v) => v,
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Few::Empty => &mut [],
            Few::Inline(items, len) => &mut items[..*len],
            Few::Heap(v) => v,
        }
    }
}

impl<T: Copy, const N: usize> FromIterator<T> for Few<T, N> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut out = Few::Empty;
        for t in iter {
            out.push(t);
        }
        out
    }
}

impl<T: Copy, const N: usize> std::ops::Deref for Few<T, N> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

/// A short list of items of any type, inline up to `N` (as `Option`s), on the heap beyond: the
/// hot path's guards, events and [`Before`] lists.
#[derive(Clone)]
pub(crate) struct Slots<T, const N: usize> {
    inline: [Option<T>; N],
    heap: Vec<T>,
}

impl<T, const N: usize> Default for Slots<T, N> {
    fn default() -> Self {
        Slots {
            inline: std::array::from_fn(|_| None),
            heap: Vec::new(),
        }
    }
}

impl<T, const N: usize> Slots<T, N> {
    /// Adds `t` after the others.
    pub(crate) fn push(&mut self, t: T) {
        match self.inline.iter_mut().find(|s| s.is_none()) {
            Some(slot) if self.heap.is_empty() => *slot = Some(t),
            _ => self.heap.push(t),
        }
    }

    /// The `i`th item pushed.
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        match i.checked_sub(N) {
            None => self.inline[i].as_ref(),
            Some(j) => self.heap.get(j),
        }
    }

    /// The `i`th item pushed.
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        match i.checked_sub(N) {
            None => self.inline[i].as_mut(),
            Some(j) => self.heap.get_mut(j),
        }
    }

    /// Every item, in the order pushed.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.inline.iter().flatten().chain(&self.heap)
    }
}

impl<T, const N: usize> FromIterator<T> for Slots<T, N> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut out = Slots::default();
        out.extend(iter);
        out
    }
}

impl<T, const N: usize> Extend<T> for Slots<T, N> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        for t in iter {
            self.push(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_lists_keep_order_inline_and_beyond() {
        for n in 0..12usize {
            let few: Few<usize, 4> = (0..n).collect();
            assert_eq!(few.as_slice(), (0..n).collect::<Vec<_>>(), "{n} items");
            assert_eq!(matches!(few, Few::Heap(_)), n > 4);
            let mut slots: Slots<String, 4> = (0..n).map(|i| i.to_string()).collect();
            let all: Vec<&String> = slots.iter().collect();
            assert_eq!(all.len(), n);
            for i in 0..n {
                assert_eq!(slots.get(i).map(String::as_str), Some(i.to_string().as_str()));
                slots.get_mut(i).expect("pushed").push('!');
            }
            assert!(slots.get(n).is_none());
            assert!(slots.iter().all(|s| s.ends_with('!')));
        }
        let mut few: Few<u32, 2> = [3, 1, 2].into_iter().collect();
        few.as_mut_slice().sort_unstable();
        assert_eq!(&*few, [1, 2, 3]);
    }
}
