//! `rfaas-billing`: what rfaas leases used and cost, in the style of
//! `sacct` and `sreport`, and the accounts' budgets.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rfaas_accounting::config::{FileConfig as AccountingFile, ManagerDatabase};
use rfaas_accounting::rates::{self, BillingConfig};
use rfaas_accounting::report::format::{self, Output, Sheet, MONEY_DECIMALS};
use rfaas_accounting::report::{
    api, budgets, group, query, time, BillingError, Filters, Key, Period,
};
use rfaas_proto::files::{ConfigDir, ACCOUNTING_TOML, BILLING_TOML, MANAGER_TOML};
use rfaas_service::{config, db};
use serde_json::{json, Map};

/// Report the usage and cost of rfaas leases per user, account, job, node
/// or lease over a period, and set the budgets the manager enforces.
///
/// Times are local, as in sacct: YYYY-MM-DD, YYYY-MM-DDTHH:MM[:SS], today,
/// now, now-N[seconds|minutes|hours|days|weeks]. The period runs from
/// --starttime (default: 00:00 today; with --jobs, the beginning) to
/// --endtime (default: now), and its edges are as fine as the accounting
/// service's snapshot interval.
///
/// Exit status: 0 done, 1 a query failed, 2 a wrong command line (a time,
/// a field, an amount), 3 a bad configuration, 4 an unknown user, account
/// or job, 5 the database or the manager cannot be reached, 6 the manager
/// refused the credential.
///
/// Reports ask the manager (GET /v1/usage) with the caller's credential,
/// which sees the usage of the caller's own leases and of the accounts
/// they belong to (the admin token: everyone's); admins may read the
/// database instead with --database.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The period's start (included).
    #[arg(long, short = 'S', value_name = "TIME")]
    starttime: Option<String>,
    /// The period's end (excluded).
    #[arg(long, short = 'E', value_name = "TIME")]
    endtime: Option<String>,
    /// Only these users' leases (comma list).
    #[arg(long, short, value_name = "USER", value_delimiter = ',')]
    user: Vec<String>,
    /// Only these accounts' leases (comma list).
    #[arg(long, short = 'A', value_name = "ACCOUNT", value_delimiter = ',')]
    account: Vec<String>,
    /// Only leases of these batch jobs (comma list of job ids).
    #[arg(long, short, value_name = "JOB", value_delimiter = ',')]
    jobs: Vec<u64>,
    /// Rows are totals by user, account, job, node or lease, or by a comma
    /// list of them (account,user: a row per user in each account).
    /// Default: account.
    #[arg(long, value_name = "KEYS")]
    by: Option<String>,
    /// The fields to print (comma list, any case): User, Account, JobID,
    /// Node, Lease, Harvested, Leases, AllocGiBSec, ComputeSec, HotPollSec,
    /// WarmSec, Invocations, BytesIn, BytesOut, Cost. Default: the --by
    /// keys, then AllocGiBSec to Cost without Leases and WarmSec.
    #[arg(long, short = 'o', value_name = "FIELDS")]
    format: Option<String>,
    /// Report from the database instead of the manager (admins): this
    /// URL, or without one `database` in the billing configuration, else
    /// the accounting service's (accounting.toml), else the manager's
    /// (manager.toml), both in the configuration directory. Without a
    /// password (refused here, where every user of the host could read
    /// it): the password comes from `database_password_file` in the
    /// billing configuration, else database.password in the configuration
    /// directory. Budget commands always use the database.
    #[arg(long, value_name = "URL", global = true, num_args = 0..=1, default_missing_value = "")]
    database: Option<String>,
    /// The managers to ask for usage (comma list of https://host:port)
    /// [env: RFAAS_MANAGERS] [default: http://127.0.0.1:7300].
    #[arg(long, value_name = "URLS", value_delimiter = ',')]
    manager: Vec<String>,
    /// The file holding the credential to ask the manager with: a user
    /// credential (`rfaasctl credential user`), or the admin token's file
    /// for every user's usage [default: RFAAS_CREDENTIAL's value].
    #[arg(long, value_name = "FILE")]
    credential_file: Option<PathBuf>,
    /// Trust only the CAs in this PEM file for the managers'
    /// certificates [env: RFAAS_CA_FILE] [default: the system's roots].
    #[arg(long, value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// Allow plain http:// to a manager that is not on loopback: the
    /// credential then crosses the network in clear.
    #[arg(long)]
    allow_http: bool,
    /// The billing configuration (currency, rates, budgets) [default:
    /// billing.toml in the configuration directory].
    #[arg(long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,
    /// The configuration directory, where billing.toml, accounting.toml and
    /// manager.toml are looked for [env: RFAAS_CONFIG_DIR] [default:
    /// /etc/rfaas].
    #[arg(long, value_name = "DIR", global = true)]
    config_dir: Option<PathBuf>,
    /// `|` between fields, none at the end of a line.
    #[arg(long, short = 'P', global = true, conflicts_with_all = ["csv", "json"])]
    parsable2: bool,
    /// Comma-separated values.
    #[arg(long, global = true, conflicts_with = "json")]
    csv: bool,
    /// One JSON document.
    #[arg(long, global = true)]
    json: bool,
    /// No title and no header line.
    #[arg(long, short = 'n', global = true)]
    noheader: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The budgets the manager enforces: an account whose spend has
    /// reached its budget gets no new lease.
    Budget {
        #[command(subcommand)]
        op: BudgetOp,
    },
}

#[derive(Debug, Subcommand)]
enum BudgetOp {
    /// Set an account's budget.
    Set {
        /// The account.
        account: String,
        /// The budget, in the configuration's currency.
        amount: f64,
    },
    /// List budgets, spend and what remains.
    List {
        /// Only these accounts (comma list).
        #[arg(long, short = 'A', value_name = "ACCOUNT", value_delimiter = ',')]
        account: Vec<String>,
    },
    /// Remove an account's budget: its leases are no longer refused for
    /// spend.
    Clear {
        /// The account.
        account: String,
    },
    /// Write the configuration's [budgets] into the database (budgets it
    /// does not name stay as they are).
    Sync,
}

impl Args {
    /// Refuses the report's options with a budget command, which would
    /// silently ignore them.
    fn check_report_options(&self) -> Result<(), BillingError> {
        let given = [
            ("--starttime", self.starttime.is_some()),
            ("--endtime", self.endtime.is_some()),
            ("--user", !self.user.is_empty()),
            ("--account", !self.account.is_empty()),
            ("--jobs", !self.jobs.is_empty()),
            ("--by", self.by.is_some()),
            ("--format", self.format.is_some()),
        ];
        match given.iter().find(|g| g.1) {
            Some((flag, _)) if self.command.is_some() => Err(BillingError::Usage(format!(
                "{flag} is an option of reports, not of budget commands"
            ))),
            _ => Ok(()),
        }
    }

    fn output(&self) -> Output {
        if self.parsable2 {
            Output::Parsable2
        } else if self.csv {
            Output::Csv
        } else if self.json {
            Output::Json
        } else {
            Output::Table
        }
    }

    fn config_dir(&self) -> ConfigDir {
        ConfigDir::resolve(self.config_dir.as_deref())
    }

    /// The billing configuration's file: --config, else billing.toml in
    /// the configuration directory.
    fn billing_file(&self) -> PathBuf {
        match &self.config {
            Some(file) => file.clone(),
            None => self.config_dir().file(BILLING_TOML),
        }
    }

    /// The billing configuration.
    fn billing(&self) -> Result<BillingConfig, BillingError> {
        let hint = match self.config {
            Some(_) => "check --config".to_owned(),
            None => self.config_dir().hint(&["--config"]),
        };
        Ok(BillingConfig::load(&self.billing_file(), &hint)?)
    }

    /// The billing configuration if given or present: a command that only
    /// prints its currency does without the default file.
    fn billing_if_any(&self) -> Result<Option<BillingConfig>, BillingError> {
        if self.config.is_none() && !self.billing_file().exists() {
            return Ok(None);
        }
        self.billing().map(Some)
    }

    /// The database URL: `--database`, else billing.toml's, else the
    /// accounting service's, else the manager's; with the password of
    /// `database.password` when it names none.
    fn database(&self, billing: Option<&BillingConfig>) -> Result<String, BillingError> {
        let given = self.database.clone().filter(|url| !url.is_empty());
        if let Some(url) = &given {
            db::refuse_password_in_argument(url, "--database").map_err(BillingError::Usage)?;
        }
        let url = match given.or_else(|| billing.and_then(|b| b.database.clone())) {
            Some(url) => url,
            None => self.configured_database()?,
        };
        let file = billing.and_then(|b| b.database_password_file.as_deref());
        db::with_password_file(&url, file, &self.config_dir()).map_err(BillingError::ManagerConfig)
    }

    /// The managers to ask, and the credential to ask with.
    fn manager_and_credential(&self) -> Result<(Vec<String>, String), BillingError> {
        let urls = if self.manager.is_empty() {
            std::env::var("RFAAS_MANAGERS")
                .unwrap_or_else(|_| "http://127.0.0.1:7300".into())
                .split(',')
                .map(str::to_owned)
                .collect()
        } else {
            self.manager.clone()
        };
        let token = match &self.credential_file {
            Some(file) => {
                rfaas_service::credentials::check_private_file(file, "the credential file")
                    .map_err(BillingError::Usage)?;
                std::fs::read_to_string(file)
                    .map_err(|e| {
                        BillingError::Usage(format!(
                            "cannot read the credential file {}: {e}",
                            file.display()
                        ))
                    })?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_owned()
            }
            None => std::env::var("RFAAS_CREDENTIAL").unwrap_or_default(),
        };
        if token.is_empty() {
            return Err(BillingError::Usage(
                "no credential to ask the manager with: give --credential-file FILE or set RFAAS_CREDENTIAL (admins may report from the database with --database)".into(),
            ));
        }
        Ok((urls, token))
    }

    /// The accounting service's database, else the manager's.
    fn configured_database(&self) -> Result<String, BillingError> {
        let dir = self.config_dir();
        let unusable = |file: &str, e: &dyn std::fmt::Display| {
            BillingError::ManagerConfig(format!(
                "{e}; {file} is read for its database, which --database overrides"
            ))
        };
        let accounting: AccountingFile = config::load_or_default(None, &dir, ACCOUNTING_TOML)
            .map_err(|e| unusable(ACCOUNTING_TOML, &e))?;
        if let Some(url) = accounting.database {
            return Ok(url);
        }
        let manager: ManagerDatabase = config::load_or_default(None, &dir, MANAGER_TOML)
            .map_err(|e| unusable(MANAGER_TOML, &e))?;
        Ok(manager
            .database
            .unwrap_or_else(|| db::DEFAULT_URL.to_owned()))
    }
}

async fn report(args: &Args) -> Result<String, BillingError> {
    let billing = args.billing()?;
    let now_ms = rfaas_service::now_ms();
    let at = |flag: &str, input: &str| {
        time::parse(input, now_ms).map_err(|e| BillingError::Usage(format!("{flag}: {e}")))
    };
    let start_ms = match &args.starttime {
        Some(s) => at("--starttime", s)?,
        // As sacct: jobs are looked up over all time.
        None if !args.jobs.is_empty() => 0,
        None => time::start_of_day(now_ms).unwrap_or(0),
    };
    let end_ms = match &args.endtime {
        Some(e) => at("--endtime", e)?,
        None => now_ms,
    };
    if start_ms >= end_ms {
        return Err(BillingError::Usage(format!(
            "the period is empty: --starttime {} is not before --endtime {}",
            time::local(start_ms),
            time::local(end_ms)
        )));
    }
    let by = Key::parse_list(args.by.as_deref().unwrap_or("account"))?;
    let fields = match &args.format {
        Some(list) => format::parse_fields(list, &by)?,
        None => format::default_fields(&by),
    };
    let filters = Filters {
        users: args.user.clone(),
        accounts: args.account.clone(),
        jobs: args.jobs.clone(),
    };
    let period = Period { start_ms, end_ms };
    let leases = if args.database.is_some() {
        let pool = query::connect(&args.database(Some(&billing))?).await?;
        query::check_known(&pool, &filters).await?;
        query::lease_usage(&pool, period, &filters, now_ms).await?
    } else {
        let (urls, token) = args.manager_and_credential()?;
        let to_now = args.endtime.is_none();
        let tls = api::Tls {
            ca_file: args.ca_file.clone(),
            allow_http: args.allow_http,
        };
        tokio::task::spawn_blocking(move || {
            api::lease_usage(&urls, &token, &tls, period, to_now, &filters)
        })
        .await
        .map_err(|e| BillingError::Database(e.to_string()))??
    };
    let rows = group(&leases, &by, &billing.rates);
    let by_names: Vec<&str> = by.iter().map(|k| k.name()).collect();
    let title = format!(
        "Usage by {}, {} - {} ({} s), costs in {}",
        by_names.join(","),
        time::local(start_ms),
        time::local(end_ms),
        (end_ms - start_ms) / 1000,
        billing.currency
    );
    let mut meta = Map::new();
    meta.insert("start".into(), json!(time::rfc3339(start_ms)));
    meta.insert("end".into(), json!(time::rfc3339(end_ms)));
    meta.insert("currency".into(), json!(billing.currency));
    meta.insert("by".into(), json!(by_names));
    Ok(Sheet::report(title, &fields, &rows, meta).render(args.output(), !args.noheader))
}

fn money(v: f64, currency: Option<&str>) -> String {
    match currency {
        Some(c) => format!("{v:.MONEY_DECIMALS$} {c}"),
        None => format!("{v:.MONEY_DECIMALS$}"),
    }
}

async fn budget(args: &Args, op: &BudgetOp) -> Result<String, BillingError> {
    let billing = match op {
        BudgetOp::Sync => Some(args.billing()?),
        _ => args.billing_if_any()?,
    };
    let currency = billing.as_ref().map(|b| b.currency.as_str());
    if let BudgetOp::Set { amount, .. } = op {
        if !rates::valid_budget(*amount) {
            return Err(BillingError::Usage(format!(
                "budget set: {amount} is not a budget; give a number of 0 or more"
            )));
        }
    }
    let pool = query::connect(&args.database(billing.as_ref())?).await?;
    let now_ms = rfaas_service::now_ms();
    Ok(match op {
        BudgetOp::Set { account, amount } => {
            let was = budgets::set(&pool, account, *amount, now_ms).await?;
            let known = Filters {
                accounts: vec![account.clone()],
                ..Filters::default()
            };
            match query::check_known(&pool, &known).await {
                Err(BillingError::Unknown(_)) => eprintln!(
                    "rfaas-billing: note: no lease was charged to account {account:?} yet; check the name if one should have been"
                ),
                other => other?,
            }
            format!(
                "account {account}: budget {} (was {})\n",
                money(*amount, currency),
                was.map_or("none".into(), |w| money(w, currency))
            )
        }
        BudgetOp::Clear { account } => {
            let was = budgets::clear(&pool, account).await?;
            format!(
                "account {account}: no budget (was {})\n",
                money(was, currency)
            )
        }
        BudgetOp::List { account } => {
            budgets::sheet(&budgets::list(&pool, account).await?, currency)
                .render(args.output(), !args.noheader)
        }
        BudgetOp::Sync => {
            let budgets = billing
                .as_ref()
                .map(|b| b.budgets.clone())
                .unwrap_or_default();
            let mut text = String::new();
            for (account, amount, was) in budgets::sync(&pool, &budgets, now_ms).await? {
                let was = match was {
                    Some(w) if w == amount => "unchanged".into(),
                    Some(w) => format!("was {}", money(w, currency)),
                    None => "was none".into(),
                };
                text.push_str(&format!(
                    "account {account}: budget {} ({was})\n",
                    money(amount, currency)
                ));
            }
            if text.is_empty() {
                text = format!(
                    "{} has no [budgets]; nothing to write\n",
                    args.billing_file().display()
                );
            }
            text
        }
    })
}

fn main() -> ExitCode {
    // A report piped into `head` ends quietly when the reader goes away,
    // as Unix tools do, rather than panicking on the failed write.
    // SAFETY: before any thread is started; SIG_DFL is a valid disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rfaas-billing: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let done = runtime.block_on(async {
        match &args.command {
            None => report(&args).await,
            Some(Command::Budget { op }) => match args.check_report_options() {
                Ok(()) => budget(&args, op).await,
                Err(e) => Err(e),
            },
        }
    });
    match done {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rfaas-billing: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
