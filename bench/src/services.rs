//! The billing services a row runs against: a real `rfaas-manager` and a
//! real `rfaas-accounting` (on the row's provider) on one SQLite file,
//! from next to the bench, started on the peers' CPU and stopped by pid
//! when dropped, failed or interrupted (see `cleanup.rs`). A site runs
//! them on other machines; the bench's own CPU is for the client alone.
//!
//! `hot_noop_billed` (`invoke.rs`) runs a daemon registered with the
//! manager against them; `billing_adds` (`billing_adds.rs`) registers a
//! node of its own and adds as that node's daemon would.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rfaas_client::lease::{Lease, LeaseRequest, Managers};
use rfaas_proto::manager::NodeLease;
use rfaas_testkit::accounting::{Accounting, AccountingOptions};
use rfaas_testkit::manager::{Manager, ManagerOptions};

use crate::child;
use crate::cleanup;
use crate::error::{Context, Error, Result};
use crate::rows::{Ctx, Kind, Provider};

/// How often the accounting service flushes, ms: the service's default,
/// as a site runs it.
pub const FLUSH_INTERVAL_MS: u64 = 1000;

/// Rates for the service's `billing.toml`; what they are does not change
/// what is measured.
const BILLING_RATES: &str =
    "currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 0.0001\ncompute_per_s = 0.01\nhot_per_s = 0.005\nharvested_discount = 0.5\n";

/// A manager and an accounting service on one SQLite file. Dropped in
/// field order: the service first, then the manager, each by pid.
#[derive(Debug)]
pub struct Services {
    pub accounting: Accounting,
    _accounting_pid: Option<cleanup::Registered>,
    pub manager: Manager,
    _manager_pid: Option<cleanup::Registered>,
}

impl Services {
    /// Starts both on the peers' CPU (and moves the bench back to its
    /// own), the manager with `manager_config` (its intervals), the
    /// service on `provider`. `row` names the row in errors.
    pub fn start(
        ctx: &Ctx,
        provider: &Provider,
        row: &str,
        manager_config: &str,
    ) -> Result<Services> {
        let mut binaries = Vec::new();
        for name in ["rfaas-manager", "rfaas-accounting"] {
            let bin = sibling(name)?;
            if !bin.exists() {
                return Err(Error::new(format!(
                    "{row}: {} does not exist: build it next to the bench \
                     (cargo build --release -p rfaas-manager -p rfaas-accounting -p rfaas-bench)",
                    bin.display()
                )));
            }
            binaries.push(bin);
        }
        if let Some(cpu) = ctx.peer_cpu {
            child::pin_current_thread(cpu)
                .context(|| format!("could not move to CPU {cpu} to start the services"))?;
        }
        let services = Services::start_here(provider, &binaries, row, manager_config);
        if let Some(cpu) = ctx.cpu {
            child::pin_current_thread(cpu)
                .context(|| format!("could not move the bench back to CPU {cpu}"))?;
        }
        services
    }

    fn start_here(
        provider: &Provider,
        binaries: &[PathBuf],
        row: &str,
        manager_config: &str,
    ) -> Result<Services> {
        let manager = Manager::try_start(
            &binaries[0],
            ManagerOptions {
                extra_config: manager_config.to_owned(),
                ..ManagerOptions::default()
            },
        )
        .map_err(|e| Error::new(format!("{row}: could not start rfaas-manager: {e}")))?;
        let manager_pid = manager.pid().map(cleanup::register);
        let listen = match provider.kind {
            Kind::Verbs => Some(format!("{}:0", provider.host()?)),
            _ => None,
        };
        let accounting = Accounting::try_start(
            &binaries[1],
            AccountingOptions {
                provider: provider.spec.clone(),
                listen,
                flush_interval_ms: FLUSH_INTERVAL_MS,
                snapshot_interval_ms: 60_000,
                billing: Some(BILLING_RATES.into()),
                ..AccountingOptions::for_manager(&manager)
            },
        )
        .map_err(|e| Error::new(format!("{row}: could not start rfaas-accounting: {e}")))?;
        let accounting_pid = accounting.pid().map(cleanup::register);
        Ok(Services {
            accounting,
            _accounting_pid: accounting_pid,
            manager,
            _manager_pid: manager_pid,
        })
    }

    /// Waits until the service has written usage to the database: proof
    /// that the row's adds were counted. `within` bounds the wait;
    /// `logs` is printed with the error.
    pub fn wait_flushed(
        &self,
        row: &str,
        within: Duration,
        logs: impl FnOnce() -> String,
    ) -> Result<()> {
        let written = r#"rfaas_accounting_rows_written_total{table="usage"}"#;
        let until = Instant::now() + within;
        while Instant::now() < until {
            if self.accounting.metric(written).is_some_and(|n| n > 0.0) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(Error::new(format!(
            "{row}: no usage reached the database, so billing was not on; {}\
             the service's log:\n{}",
            logs(),
            self.accounting.log()
        )))
    }
}

/// `name` next to the bench's own executable.
pub fn sibling(name: &str) -> Result<PathBuf> {
    Ok(std::env::current_exe()
        .context(|| "could not find the bench's own executable".to_owned())?
        .with_file_name(name))
}

/// Writes `credential` to `path`, readable by its owner only (a daemon
/// refuses a credential file others may read).
pub fn write_credential(path: &Path, credential: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, credential).context(|| format!("could not write {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .context(|| format!("could not restrict {}", path.display()))
}

/// A lease as `want` asks, whose node part has a billing slot: the manager
/// grants leases unbilled until it has seen the service alive, and refuses
/// them until it has seen the node, so this asks again until both are in
/// (30 s at most). `row` names the row in errors.
pub fn billed_lease(
    managers: &Managers,
    want: &LeaseRequest,
    row: &str,
) -> Result<(Lease, NodeLease)> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let last = match managers.request(want, Duration::from_secs(10)) {
            Ok(lease) => match lease.nodes().into_iter().next() {
                Some(n) if n.billing.is_some() => return Ok((lease, n)),
                _ => {
                    let _ = lease.release();
                    "the lease came without a billing slot".to_owned()
                }
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() >= until {
            return Err(Error::new(format!(
                "{row}: no billed lease from the manager within 30 s: {last}"
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
