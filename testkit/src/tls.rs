//! A throwaway certificate authority per test run, made by
//! `scripts/lib.sh`'s `make_test_ca` (one recipe for the scripts and the
//! tests): the CA file clients trust and a server certificate for
//! 127.0.0.1, ::1 and localhost.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// A CA and one server certificate it signed, in a directory.
#[derive(Debug, Clone)]
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    /// Makes a CA in `dir`, its server certificate naming each of `names`
    /// (DNS names or IP addresses); none: 127.0.0.1, ::1 and localhost.
    pub fn make(dir: &Path, names: &[&str]) -> Result<TestCa, String> {
        let lib = crate::repo_root().join("scripts/lib.sh");
        let out = Command::new("bash")
            .arg("-c")
            .arg("source \"$0\" && make_test_ca \"$@\"")
            .arg(&lib)
            .arg(dir)
            .args(names)
            .output()
            .map_err(|e| format!("run bash for make_test_ca: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "make_test_ca {} failed: {}",
                dir.display(),
                crate::output_text(&out)
            ));
        }
        Ok(TestCa {
            dir: dir.to_owned(),
        })
    }

    /// The CA certificate, what clients trust.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The server's certificate.
    pub fn cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// The server's key.
    pub fn key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
}

/// This test process's CA, made at first use. Its file is also put in
/// this process's `RFAAS_CA_FILE`, so the client library in the test and
/// every process the test starts trust the managers [`crate::manager`]
/// starts with its certificate. (Set once, before any client of it exists;
/// tests run one per process under nextest.)
///
/// Where `RFAAS_TEST_CA_DIR` names a directory `make_test_ca` filled, that
/// CA is used instead: the Soft-RoCE VM has no openssl, so
/// scripts/test-verbs.sh makes one on the host for the guest's tests.
pub fn test_ca() -> &'static TestCa {
    static CA: OnceLock<TestCa> = OnceLock::new();
    CA.get_or_init(|| {
        let made = std::env::var_os("RFAAS_TEST_CA_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .filter(|d| d.join("ca.pem").exists());
        let ca = match made {
            Some(dir) => TestCa { dir },
            None => {
                let dir =
                    std::env::temp_dir().join(format!("rfaas-test-ca-{}", std::process::id()));
                TestCa::make(&dir, &[]).unwrap_or_else(|e| panic!("{e}"))
            }
        };
        std::env::set_var(rfaas_tls::CA_FILE_ENV, ca.ca_file());
        ca
    })
}
