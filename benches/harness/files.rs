//! An all-gather of rank processes through files in a folder they all see, in place of NCCL's,
//! for the benchmarks that run verification alone (`handoff::nccl::rehearsal`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a rank waits for the others' files of one round.
const ROUND_LIMIT: Duration = Duration::from_secs(120);

/// Each round, each rank writes its words to a file of its own (renamed into place whole),
/// then reads everyone's, in rank order.
pub struct FileGather {
    dir: PathBuf,
    rank: usize,
    world: usize,
    round: usize,
}

impl FileGather {
    pub fn new(dir: PathBuf, rank: usize, world: usize) -> FileGather {
        FileGather {
            dir,
            rank,
            world,
            round: 0,
        }
    }

    /// Every rank's `words`, in rank order, or why not.
    pub fn gather(&mut self, words: &[u64]) -> Result<Vec<u64>, String> {
        let name = |r: usize| self.dir.join(format!("round{}-rank{r}", self.round));
        let tmp = self
            .dir
            .join(format!("tmp-round{}-rank{}", self.round, self.rank));
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, name(self.rank)).map_err(|e| e.to_string())?;
        let mut all = Vec::new();
        for r in 0..self.world {
            wait_for(&name(r), ROUND_LIMIT)?;
            let b = std::fs::read(name(r)).map_err(|e| e.to_string())?;
            all.extend(b.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())));
        }
        self.round += 1;
        Ok(all)
    }
}

/// Waits up to `limit` for `f` to exist, looking every millisecond.
pub fn wait_for(f: &Path, limit: Duration) -> Result<(), String> {
    let until = Instant::now() + limit;
    while !f.exists() {
        if Instant::now() > until {
            return Err(format!("{} did not appear within {limit:?}", f.display()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
