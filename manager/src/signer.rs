//! The key that signs lease tokens.

use std::path::Path;

use rfaas_proto::lease::LeaseClaims;

/// Signs lease claims into tokens executors check.
#[derive(Debug)]
pub struct Signer {
    secret: Vec<u8>,
}

impl Signer {
    /// Loads the key in `path`.
    pub fn load(path: &Path) -> Result<Signer, String> {
        let secret = std::fs::read(path)
            .map_err(|e| format!("cannot read the lease key {}: {e}", path.display()))?;
        Ok(Signer { secret })
    }

    /// The token for `claims`.
    pub fn sign(&self, claims: &LeaseClaims) -> String {
        claims
            .sign(&self.secret)
            .expect("the key was checked at load")
    }
}
