//! The ledger: the counter region and one window per node, so each add is
//! known to come from the node whose connection made it.
//!
//! A fetch-and-add is one-sided: the service never sees who made it. So a
//! node's connection is never given the region itself but its node's
//! window: a file of the region's layout and size
//! (`<region_file>.nodes/<node>.region`), made when the node first says an
//! accepted hello and registered for that connection alone
//! ([`Region::expose`]). The daemon adds at the same offsets as it would
//! into the region; the bytes land in its node's window only.
//!
//! A slot's totals are the region's words plus those of the window of the
//! node that holds the slot's lease ([`Ledger::read_slot`]): the region
//! keeps what was added before windows existed, and the totals a replaced
//! region was seeded with. Adds in another node's window, to a slot whose
//! lease is not on that node, are never counted: the flusher takes them
//! out and counts them in `rfaas_accounting_rejected_adds_total
//! {reason="foreign_slot"}` ([`Ledger::take_foreign`]).
//!
//! A window costs its file (sparse: a page per 64 slots touched) and its
//! mappings, one for the service and one per connection of its node.
//! Windows outlive the service, like the region: adds that landed survive
//! a crash. A region made anew (the file was lost) starts with no windows.

use std::collections::HashMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use rfaas_fabric::Domain;
use rfaas_proto::accounting::SlotTotals;

use crate::region::{Region, RegionError};

/// The region and the windows of the nodes that connected.
#[derive(Debug)]
pub struct Ledger {
    main: Arc<Region>,
    domain: Arc<Domain>,
    dir: PathBuf,
    windows: Mutex<HashMap<String, Arc<Region>>>,
}

/// The directory of `region`'s windows.
pub fn windows_dir(region: &Path) -> PathBuf {
    let mut name = region.as_os_str().to_owned();
    name.push(".nodes");
    PathBuf::from(name)
}

/// A node's name as a file name: bytes other than ASCII letters, digits,
/// `-` and `_` as `%XX`, so no name climbs out of the directory.
fn file_name(node: &str) -> String {
    let mut out = String::with_capacity(node.len() + 7);
    for b in node.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out.push_str(".region");
    out
}

/// The node a window's file name stands for (`None`: not a window).
fn node_of(file: &str) -> Option<String> {
    let stem = file.strip_suffix(".region")?;
    let mut bytes = Vec::with_capacity(stem.len());
    let mut it = stem.bytes();
    while let Some(b) = it.next() {
        if b == b'%' {
            let hex = [it.next()?, it.next()?];
            bytes.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            bytes.push(b);
        }
    }
    String::from_utf8(bytes).ok()
}

fn add(a: &SlotTotals, b: &SlotTotals) -> SlotTotals {
    let (a, b) = (a.to_words(), b.to_words());
    SlotTotals::from_words(std::array::from_fn(|i| a[i].saturating_add(b[i])))
}

impl Ledger {
    /// The ledger of `main`, with the windows its directory holds (made
    /// `0700` if missing). With `replaced` (the region was just made
    /// anew), windows left from the old region are removed first: their
    /// adds belonged to it.
    ///
    /// # Errors
    ///
    /// The directory cannot be made or read, or a window cannot be opened.
    pub fn open(
        domain: Arc<Domain>,
        main: Arc<Region>,
        replaced: bool,
    ) -> Result<Ledger, RegionError> {
        let dir = windows_dir(main.path());
        let io = |what, source| RegionError::Io {
            what,
            path: dir.clone(),
            source,
        };
        if replaced && dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io("remove the old windows in", e))?;
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io("create", e))?;
        let mut windows = HashMap::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| io("read", e))? {
            let entry = entry.map_err(|e| io("read", e))?;
            let Some(node) = entry.file_name().to_str().and_then(node_of) else {
                continue;
            };
            let (w, _) = Region::open(&domain, &entry.path(), main.slots())?;
            windows.insert(node, Arc::new(w));
        }
        Ok(Ledger {
            main,
            domain,
            dir,
            windows: Mutex::new(windows),
        })
    }

    /// The region.
    pub fn main(&self) -> &Arc<Region> {
        &self.main
    }

    /// Slots of the region (and of every window).
    pub fn slots(&self) -> u32 {
        self.main.slots()
    }

    /// `node`'s window, made if it has none yet.
    ///
    /// # Errors
    ///
    /// The window's file cannot be made, opened or registered.
    pub fn window(&self, node: &str) -> Result<Arc<Region>, RegionError> {
        let mut windows = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = windows.get(node) {
            return Ok(w.clone());
        }
        let path = self.dir.join(file_name(node));
        let (w, _) = Region::open(&self.domain, &path, self.slots())?;
        let w = Arc::new(w);
        windows.insert(node.to_owned(), w.clone());
        Ok(w)
    }

    /// Every window, by node.
    pub fn windows(&self) -> Vec<(String, Arc<Region>)> {
        let windows = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        windows
            .iter()
            .map(|(n, w)| (n.clone(), w.clone()))
            .collect()
    }

    fn window_of(&self, node: Option<&str>) -> Option<Arc<Region>> {
        let windows = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        node.and_then(|n| windows.get(n).cloned())
    }

    /// The totals of `slot` for a lease on `node`: the region's words
    /// plus its window's (each sum saturating).
    pub fn read_slot(&self, node: Option<&str>, slot: u32) -> SlotTotals {
        let main = self.main.read_slot(slot);
        match self.window_of(node) {
            Some(w) => add(&main, &w.read_slot(slot)),
            None => main,
        }
    }

    /// Zeroes `slot` in the region and in `node`'s window; what they held
    /// together ([`Region::take_slot`]).
    pub fn take_slot(&self, node: Option<&str>, slot: u32) -> SlotTotals {
        let main = self.main.take_slot(slot);
        match self.window_of(node) {
            Some(w) => add(&main, &w.take_slot(slot)),
            None => main,
        }
    }

    /// Adds `totals` back into `slot` ([`Region::restore_slot`]): into
    /// `node`'s window if it has one, where its daemon reads it.
    pub fn restore_slot(&self, node: Option<&str>, slot: u32, totals: &SlotTotals) {
        match self.window_of(node) {
            Some(w) => w.restore_slot(slot, totals),
            None => self.main.restore_slot(slot, totals),
        }
    }

    /// Syncs `slot` of the region and of `node`'s window to their files.
    ///
    /// # Errors
    ///
    /// `msync` failed.
    pub fn sync_slot(&self, node: Option<&str>, slot: u32) -> std::io::Result<()> {
        self.main.sync_slots(slot, 1)?;
        match self.window_of(node) {
            Some(w) => w.sync_slots(slot, 1),
            None => Ok(()),
        }
    }

    /// Syncs the region and every window to their files.
    ///
    /// # Errors
    ///
    /// The first `msync` that failed (the others are still tried).
    pub fn sync_all(&self) -> std::io::Result<()> {
        let mut first = self.main.sync_all().err();
        for (_, w) in self.windows() {
            if let Err(e) = w.sync_all() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Takes out of every window the adds to slots that `holder` does not
    /// give to that window's node (`holder(slot)`: the node of the lease
    /// holding `slot`, `None` for a free slot, which [`Ledger::take_free`]
    /// handles). Returns `(node, slot, what it held)` of each.
    pub fn take_foreign<'a>(
        &self,
        holder: impl Fn(u32) -> Option<Option<&'a str>>,
    ) -> Vec<(String, u32, SlotTotals)> {
        let mut out = Vec::new();
        for (node, w) in self.windows() {
            for slot in 0..self.slots() {
                let Some(held_by) = holder(slot) else {
                    continue;
                };
                if held_by == Some(node.as_str()) || w.read_slot(slot) == SlotTotals::default() {
                    continue;
                }
                out.push((node.clone(), slot, w.take_slot(slot)));
            }
        }
        out
    }

    /// What `slot` holds in the region and in any window, summed.
    pub fn read_anywhere(&self, slot: u32) -> SlotTotals {
        self.windows()
            .iter()
            .fold(self.main.read_slot(slot), |t, (_, w)| {
                add(&t, &w.read_slot(slot))
            })
    }

    /// Zeroes `slot` in the region and in every window; what they held.
    pub fn take_anywhere(&self, slot: u32) -> SlotTotals {
        self.windows()
            .iter()
            .fold(self.main.take_slot(slot), |t, (_, w)| {
                add(&t, &w.take_slot(slot))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_map_to_file_names_and_back() {
        for node in ["n1", "node-7_a", "../../etc", "a.b", "ünï", "%41"] {
            let f = file_name(node);
            assert!(!f.contains('/') && !f.starts_with('.'), "{f}");
            assert_eq!(node_of(&f).as_deref(), Some(node));
        }
        assert_eq!(node_of("x.lock"), None);
        assert_eq!(node_of("x.region.lock"), None);
    }
}
