//! The node credential and the job credentials this node handed out, kept
//! until their job ends here ([`super`] says when they are made and
//! dropped).

use std::collections::BTreeMap;
use std::sync::Mutex;

/// A job's credential, as handed out.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub uid: u32,
    pub vars: BTreeMap<String, String>,
    pub expires_at: u64,
}

/// The node credential and the job credentials this node handed out.
#[derive(Debug)]
pub(crate) struct Jobs {
    pub(super) node_credential: Option<String>,
    held: Mutex<BTreeMap<u64, Held>>,
}

impl Jobs {
    /// With the node's credential for the managers, if configured.
    pub(crate) fn new(node_credential: Option<String>) -> Jobs {
        Jobs {
            node_credential,
            held: Mutex::new(BTreeMap::new()),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}
