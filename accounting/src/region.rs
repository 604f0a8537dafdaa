//! The counter region: a [`RegionHeader`] and `slots` slots of eight
//! words (layout in [`rfaas_proto::accounting`]), kept in a file mapped
//! shared and registered on the fabric for remote atomics and reads only.
//!
//! Executor daemons add into it with fetch-and-add; the NIC (verbs), the
//! fabric's progress thread (tcp) or the daemon itself (shm, through its
//! mapping of the file) applies each add to the file's pages, so an add
//! that completed survives a crash or `kill -9` of this service: the
//! kernel holds the pages and writes them back. The service itself only
//! reads words, and zeroes a slot before it frees it.
//!
//! A `<file>.lock` next to the file, locked with `flock`, keeps a second
//! service off the same region. The lock is on a file of its own because
//! the region's descriptor is handed to shm peers, whose copies would keep
//! a lock on it alive after this process died.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rfaas_fabric::{page_size, Access, Buffer, Domain, MemoryRegion, RemoteDescriptor};
use rfaas_proto::accounting::{
    region_len, slot_offset, word_offset, AccountingFormatError, Counter, RegionHeader, SlotTotals,
    REGION_HEADER_LEN, SLOT_LEN,
};

/// Why the region cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// A file operation failed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another process holds the region.
    #[error("another rfaas-accounting holds the region file {path} (its lock {path}.lock is taken): run one service per region file")]
    Locked {
        /// The region file.
        path: PathBuf,
    },
    /// The file is not a region this build reads.
    #[error("{path} is not an rfaas accounting region: {source}; move it away or point region_file elsewhere")]
    NotARegion {
        /// The file.
        path: PathBuf,
        /// What is wrong with its header.
        #[source]
        source: AccountingFormatError,
    },
    /// The file holds another slot count than configured.
    #[error("the region file {path} holds {found} slots, the configuration says {configured}: set slots = {found}, or move the file away to start a new region (adds not yet flushed to the database are lost with it)")]
    SlotCount {
        /// The file.
        path: PathBuf,
        /// Slots in the file.
        found: u32,
        /// Slots configured.
        configured: u32,
    },
    /// The file is shorter than its header says.
    #[error("the region file {path} is {len} bytes, its {slots} slots need {needed}: it was truncated; move it away to start a new region")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// Slots in its header.
        slots: u32,
        /// The length they need.
        needed: u64,
    },
    /// The fabric refused to map or register the region.
    #[error("cannot register the region file {path} on the fabric: {source}")]
    Fabric {
        /// The file.
        path: PathBuf,
        /// The fabric's error.
        #[source]
        source: rfaas_fabric::Error,
    },
}

/// The mapped, registered region.
#[derive(Debug)]
pub struct Region {
    mr: MemoryRegion,
    header: RegionHeader,
    path: PathBuf,
    /// The file, kept open to map it again for each accepted connection
    /// ([`Region::expose`]).
    file: File,
    _lock: File,
}

/// The file's length for `slots`: the region, rounded up to whole pages
/// (shm peers map whole pages).
fn file_len(slots: u32) -> u64 {
    let page = page_size() as u64;
    region_len(slots).div_ceil(page) * page
}

impl Region {
    /// Opens the region file at `path`, or creates it (zeroed, with a
    /// random region id) when there is none, and registers it in `domain`
    /// with [`Access::REMOTE_ATOMIC`] and [`Access::REMOTE_READ`]. Returns
    /// the region and whether it was created.
    ///
    /// # Errors
    ///
    /// A file that is not a region, holds another slot count than `slots`,
    /// or was truncated; a region locked by another service; file and
    /// fabric failures.
    pub fn open(domain: &Domain, path: &Path, slots: u32) -> Result<(Region, bool), RegionError> {
        let io = |what, source| RegionError::Io {
            what,
            path: path.to_owned(),
            source,
        };
        let lock_path = lock_path(path);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| io("create the lock file of", e))?;
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EWOULDBLOCK) => RegionError::Locked {
                    path: path.to_owned(),
                },
                _ => io("lock", e),
            });
        }
        let created = !path.exists();
        if created {
            create(path, slots)?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io("open", e))?;
        let mut head = [0u8; REGION_HEADER_LEN];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => RegionError::NotARegion {
                    path: path.to_owned(),
                    source: AccountingFormatError::BufferTooShort {
                        what: "accounting region header",
                        needed: REGION_HEADER_LEN,
                        len: 0,
                    },
                },
                _ => io("read the header of", e),
            })?;
        let header = RegionHeader::decode(&head).map_err(|source| RegionError::NotARegion {
            path: path.to_owned(),
            source,
        })?;
        if header.slots != slots {
            return Err(RegionError::SlotCount {
                path: path.to_owned(),
                found: header.slots,
                configured: slots,
            });
        }
        let len = file.metadata().map_err(|e| io("stat", e))?.len();
        if len < region_len(slots) {
            return Err(RegionError::Truncated {
                path: path.to_owned(),
                len,
                slots,
                needed: region_len(slots),
            });
        }
        if len < file_len(slots) {
            // Only the tail of the last page: nothing of the region is lost.
            file.set_len(file_len(slots))
                .map_err(|e| io("extend to whole pages", e))?;
        }
        let fabric = |source| RegionError::Fabric {
            path: path.to_owned(),
            source,
        };
        let again = file
            .try_clone()
            .map_err(|e| io("duplicate the descriptor of", e))?;
        let buf = Buffer::map_file(file, region_len(slots) as usize).map_err(fabric)?;
        let mr = domain
            .register_buffer(buf, Access::REMOTE_ATOMIC | Access::REMOTE_READ)
            .map_err(fabric)?;
        Ok((
            Region {
                mr,
                header,
                path: path.to_owned(),
                file: again,
                _lock: lock,
            },
            created,
        ))
    }

    /// The header read from the file.
    pub fn header(&self) -> RegionHeader {
        self.header
    }

    /// Slots in the region.
    pub fn slots(&self) -> u32 {
        self.header.slots
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What daemons name the region by (the accepted hello's reply).
    pub fn descriptor(&self) -> RemoteDescriptor {
        self.mr.descriptor()
    }

    /// Maps the region's file again and registers that mapping in
    /// `domain` (an accepted connection's own), with the rights of
    /// [`Region::open`]: the returned region, and its rkey, name the
    /// counters on that domain's endpoints only. Dropping it deregisters
    /// and unmaps it; adds that landed stay in the file.
    ///
    /// # Errors
    ///
    /// The file cannot be duplicated, mapped or registered.
    pub fn expose(&self, domain: &Domain) -> Result<MemoryRegion, RegionError> {
        let fabric = |source| RegionError::Fabric {
            path: self.path.clone(),
            source,
        };
        let file = self.file.try_clone().map_err(|source| RegionError::Io {
            what: "duplicate the descriptor of",
            path: self.path.clone(),
            source,
        })?;
        let buf = Buffer::map_file(file, self.mr.len()).map_err(fabric)?;
        domain.register_buffer(buf, self.access()).map_err(fabric)
    }

    /// The rights it is registered with.
    pub fn access(&self) -> Access {
        self.mr.access()
    }

    fn word(&self, slot: u32, counter: Counter) -> &AtomicU64 {
        assert!(
            slot < self.header.slots,
            "slot {slot} is outside the region"
        );
        let at = word_offset(slot, counter) as usize;
        // SAFETY: `at` + 8 lies inside the mapping (slot < slots, and the
        // mapping holds region_len(slots) bytes), which lives as long as
        // `self`; `at` is a multiple of 8 from a page-aligned base, so the
        // word is aligned. Peers change it only with atomic operations.
        unsafe { &*self.mr.as_ptr().add(at).cast::<AtomicU64>() }
    }

    /// The slot's words now. Each word is read atomically; words added to
    /// meanwhile may show the add or not.
    pub fn read_slot(&self, slot: u32) -> SlotTotals {
        let mut w = [0u64; 8];
        for c in Counter::ALL {
            w[c.index()] = self.word(slot, c).load(Ordering::Acquire);
        }
        SlotTotals::from_words(w)
    }

    /// Sets every word of the slot to 0 and returns what they held, each
    /// word exchanged atomically, so an add racing with it is either in
    /// the returned totals or left in the slot.
    pub fn take_slot(&self, slot: u32) -> SlotTotals {
        let mut w = [0u64; 8];
        for c in Counter::ALL {
            w[c.index()] = self.word(slot, c).swap(0, Ordering::AcqRel);
        }
        SlotTotals::from_words(w)
    }

    /// Adds `totals` back into the slot's words (after a
    /// [`take_slot`](Self::take_slot) that must be undone), atomically
    /// word by word, so adds meanwhile are kept too.
    pub fn restore_slot(&self, slot: u32, totals: &SlotTotals) {
        for c in Counter::ALL {
            self.word(slot, c)
                .fetch_add(totals.get(c), Ordering::AcqRel);
        }
    }

    /// Writes the slot's words (the region was just created and nobody
    /// adds yet: it seeds a replaced region with the database's totals).
    pub fn seed_slot(&self, slot: u32, totals: &SlotTotals) {
        for c in Counter::ALL {
            self.word(slot, c).store(totals.get(c), Ordering::Release);
        }
    }

    /// Writes the pages holding slots `first..first + count` to the file
    /// and waits (`msync`): what the database is about to be told, or a
    /// slot about to be freed, is then on the disk too.
    pub fn sync_slots(&self, first: u32, count: u32) -> std::io::Result<()> {
        if count == 0 {
            return Ok(());
        }
        let page = page_size();
        let start = slot_offset(first) as usize / page * page;
        let end = (slot_offset(first) as usize + count as usize * SLOT_LEN).min(self.mr.len());
        // SAFETY: start..end lies inside our mapping, start is page-aligned;
        // msync reads no memory through the pointer.
        let rc = unsafe {
            libc::msync(
                self.mr.as_ptr().add(start).cast(),
                end - start,
                libc::MS_SYNC,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// [`sync_slots`](Self::sync_slots) of every slot.
    pub fn sync_all(&self) -> std::io::Result<()> {
        self.sync_slots(0, self.header.slots)
    }
}

fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Makes a new region file: written whole under another name, synced,
/// then renamed, so a crash leaves either no file or a whole one.
fn create(path: &Path, slots: u32) -> Result<(), RegionError> {
    let io = |what, source| RegionError::Io {
        what,
        path: path.to_owned(),
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let region_id = loop {
        let id = rfaas_service::credentials::random_bytes(8)
            .map_err(|e| io("draw a region id for", e))?;
        let id = u64::from_le_bytes(id.try_into().expect("8 bytes"));
        if id != 0 {
            break id;
        }
    };
    let header = RegionHeader {
        slots,
        region_id,
        created_ms: rfaas_service::now_ms(),
    };
    let mut head = [0u8; REGION_HEADER_LEN];
    header
        .encode(&mut head)
        .map_err(|source| RegionError::NotARegion {
            path: path.to_owned(),
            source,
        })?;
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io("create", e))?;
    file.set_len(file_len(slots)).map_err(|e| io("size", e))?;
    file.write_all(&head)
        .map_err(|e| io("write the header of", e))?;
    file.sync_all().map_err(|e| io("sync", e))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| io("rename the new region to", e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("sync the directory of", e))?;
    }
    tracing::info!(path = %path.display(), slots, region_id, "created a new accounting region");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::accounting::UsageFigures;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rfaas-region-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_region_is_created_once_and_keeps_its_words() {
        let d = dir("keep");
        let path = d.join("r");
        let fabric = rfaas_fabric::Fabric::open("tcp").unwrap();
        let domain = fabric.domain().unwrap();
        let (r, created) = Region::open(&domain, &path, 8).unwrap();
        assert!(created);
        assert_eq!(r.access(), Access::REMOTE_ATOMIC | Access::REMOTE_READ);
        assert_eq!(r.descriptor().len as u64, region_len(8));
        let id = r.header().region_id;
        assert_ne!(id, 0);
        let t = SlotTotals {
            usage: UsageFigures {
                compute_ns: 7,
                ..UsageFigures::default()
            },
            closed: 1,
        };
        r.seed_slot(7, &t);
        r.sync_slots(7, 1).unwrap();
        // A second service on the same file is refused while this one runs.
        let err = Region::open(&domain, &path, 8).unwrap_err();
        assert!(matches!(err, RegionError::Locked { .. }), "{err}");
        drop(r);
        let (r, created) = Region::open(&domain, &path, 8).unwrap();
        assert!(!created);
        assert_eq!(r.header().region_id, id);
        assert_eq!(r.read_slot(7), t);
        assert_eq!(r.take_slot(7), t);
        assert_eq!(r.read_slot(7), SlotTotals::default());
        assert_eq!(
            std::fs::metadata(&path).unwrap().len() % page_size() as u64,
            0
        );
        drop(r);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_of_another_shape_is_refused_with_what_to_do() {
        let d = dir("shape");
        let path = d.join("r");
        let fabric = rfaas_fabric::Fabric::open("tcp").unwrap();
        let domain = fabric.domain().unwrap();
        drop(Region::open(&domain, &path, 8).unwrap());
        let err = Region::open(&domain, &path, 16).unwrap_err();
        assert!(
            matches!(
                err,
                RegionError::SlotCount {
                    found: 8,
                    configured: 16,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("set slots = 8"), "{err}");
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(100).unwrap();
        let err = Region::open(&domain, &path, 8).unwrap_err();
        assert!(matches!(err, RegionError::Truncated { .. }), "{err}");
        std::fs::write(
            &path,
            b"not a region at all, just some text of more than sixty-four bytes, see?",
        )
        .unwrap();
        let err = Region::open(&domain, &path, 8).unwrap_err();
        assert!(matches!(err, RegionError::NotARegion { .. }), "{err}");
        std::fs::write(&path, b"short").unwrap();
        let err = Region::open(&domain, &path, 8).unwrap_err();
        assert!(matches!(err, RegionError::NotARegion { .. }), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
