//! `rfaasctl`: the rfaas admin's command line, over the managers' REST API.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rfaas_manager::ctl::{self, Ctl, CtlError};
use rfaas_proto::files::{ConfigDir, ADMIN_TOKEN};
use rfaas_proto::manager::{BudgetView, Credential, LeaseView, NodeView};
use serde_json::{json, Value};

/// Look after an rfaas pool: see its nodes and leases, drain and resume
/// nodes, release leases, give nodes and users their credentials, and set
/// accounts' budgets.
///
/// rfaasctl talks to the rfaas managers over HTTPS with the admin token.
/// It exits 1 when the manager refuses (its message says why) or cannot be
/// reached, and 2 when the command line is wrong.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// A manager's URL, https://host:port (plain http://host:port only
    /// on loopback, or with --allow-http). Give several (repeat the option
    /// or separate them by commas) and each is tried in turn until one can
    /// be reached.
    #[arg(
        long = "manager",
        value_name = "URL",
        env = "RFAAS_MANAGERS",
        value_delimiter = ',',
        default_value = ctl::DEFAULT_MANAGER,
        value_parser = ctl::parse_manager_url,
        global = true
    )]
    managers: Vec<String>,
    /// The file holding the admin token. It must be readable by its owner
    /// only, as the manager's own copy [default: admin.token in the
    /// configuration directory].
    #[arg(
        long,
        value_name = "FILE",
        env = "RFAAS_ADMIN_TOKEN_FILE",
        global = true
    )]
    token_file: Option<PathBuf>,
    /// The configuration directory, where admin.token is looked for
    /// [env: RFAAS_CONFIG_DIR] [default: /etc/rfaas].
    #[arg(long, value_name = "DIR", global = true)]
    config_dir: Option<PathBuf>,
    /// Trust only the CAs in this PEM file for the managers'
    /// certificates [env: RFAAS_CA_FILE] [default: the system's roots].
    #[arg(long, value_name = "FILE", global = true)]
    ca_file: Option<PathBuf>,
    /// Allow plain http:// to a manager that is not on loopback: the
    /// admin token then crosses the network in clear.
    #[arg(long, global = true)]
    allow_http: bool,
    /// Read the token from this environment variable instead of a file.
    #[arg(long, value_name = "VAR", global = true)]
    token_env: Option<String>,
    /// Print the manager's answer as JSON instead of a table (nothing for
    /// `release`, `revoke` and `budget clear`, which answer nothing).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the nodes, their state and what is leased on each.
    Nodes {
        /// Ask the database, not the manager's view (which may be up to a
        /// second old).
        #[arg(long)]
        fresh: bool,
        /// Only nodes in this state.
        #[arg(long, value_parser = ["up", "drained", "lost"])]
        state: Option<String>,
        /// Only nodes whose name starts with this.
        #[arg(long)]
        prefix: Option<String>,
        /// Only nodes in this Slurm partition.
        #[arg(long)]
        partition: Option<String>,
        /// Nodes per request to the manager (1 to 10000); every page is
        /// read and printed as one list.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
        page_size: Option<u32>,
    },
    /// Show one node.
    Node {
        /// The node's name.
        name: String,
    },
    /// Stop offering a node; leases on it run to their end.
    Drain {
        /// The node's name.
        name: String,
    },
    /// Offer a drained node again.
    Resume {
        /// The node's name.
        name: String,
    },
    /// List the leases in force, newest first.
    Leases {
        /// Also the leases that have ended.
        #[arg(long)]
        all: bool,
        /// Only leases in this state (implies --all for ended states).
        #[arg(long, value_parser = ["active", "released", "expired", "lost"])]
        state: Option<String>,
        /// Only leases whose workers run as this user.
        #[arg(long)]
        user: Option<String>,
        /// Only leases charged to this account.
        #[arg(long)]
        account: Option<String>,
        /// Only leases on this node.
        #[arg(long)]
        node: Option<String>,
        /// Only leases for this batch job.
        #[arg(long, value_name = "JOB_ID")]
        job: Option<u64>,
        /// Show at most this many, the newest (one page; without it,
        /// every lease, page by page).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: Option<u32>,
    },
    /// Release a grant (all its node leases) at once.
    Release {
        /// The grant's id (the GRANT column of `rfaasctl leases`).
        grant_id: u64,
    },
    /// Make a credential; its token alone goes to standard output, so
    /// `rfaasctl credential node n1 > n1.credential` saves it.
    #[command(subcommand)]
    Credential(NewCredential),
    /// List the credentials not revoked (without their tokens).
    Credentials,
    /// Revoke a credential: every manager refuses it within seconds.
    Revoke {
        /// The credential's id (the ID column of `rfaasctl credentials`).
        id: String,
    },
    /// Accounts' budgets: once an account has spent its budget, its new
    /// leases are refused; the leases it holds run on.
    #[command(subcommand)]
    Budget(BudgetCommand),
}

#[derive(Debug, Subcommand)]
enum BudgetCommand {
    /// Set what an account may spend (in the accounting rates' currency).
    Set {
        /// The account.
        account: String,
        /// The budget: a number from 0, such as 100 or 12.50.
        #[arg(value_parser = ctl::parse_budget)]
        budget: f64,
    },
    /// List the budgets, with what each account has spent.
    List,
    /// Remove an account's budget: its leases are no longer refused for
    /// spend.
    Clear {
        /// The account.
        account: String,
    },
}

#[derive(Debug, Subcommand)]
enum NewCredential {
    /// For a user's jobs, to ask for leases.
    User {
        /// The user's login name; workers run as this user.
        user: String,
        /// The account the user's leases are charged to (default: the
        /// user's name).
        #[arg(long)]
        account: Option<String>,
        /// Let it expire after this long: 30d, 12h, 90m, 3600s (default:
        /// never).
        #[arg(long, value_parser = ctl::parse_duration)]
        ttl: Option<u64>,
    },
    /// For a node's executor daemon, to register and heartbeat.
    Node {
        /// The node's name, as its daemon's `node_name`.
        name: String,
        /// Let it expire after this long: 30d, 12h, 90m, 3600s (default:
        /// never).
        #[arg(long, value_parser = ctl::parse_duration)]
        ttl: Option<u64>,
    },
}

fn token(args: &Args) -> Result<String, CtlError> {
    let Some(var) = &args.token_env else {
        let dir = ConfigDir::resolve(args.config_dir.as_deref());
        let file = match &args.token_file {
            Some(file) => file.clone(),
            None => dir.file(ADMIN_TOKEN),
        };
        return rfaas_manager::auth::read_admin_token(&file).map_err(|e| {
            CtlError::Token(format!(
                "{e}; {}",
                dir.hint(&["--token-file", "RFAAS_ADMIN_TOKEN_FILE", "--token-env"])
            ))
        });
    };
    let value = std::env::var(var).map_err(|_| {
        CtlError::Token(format!(
            "the environment variable {var} (--token-env) is not set"
        ))
    })?;
    let value = value.trim();
    if value.is_empty() || value.contains(char::is_whitespace) {
        return Err(CtlError::Token(format!(
            "the environment variable {var} (--token-env) must hold one token"
        )));
    }
    Ok(value.to_owned())
}

fn print_json(v: &Value) {
    if !v.is_null() {
        println!(
            "{}",
            serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
        );
    }
}

fn run(args: &Args) -> Result<(), CtlError> {
    let urls = args.managers.clone();
    let plain = if args.allow_http {
        rfaas_tls::PlainHttp::Allowed
    } else {
        rfaas_tls::PlainHttp::LoopbackOnly
    };
    let ctl = Ctl::new(urls.clone(), token(args)?, args.ca_file.clone(), plain)?;
    let now_ms = rfaas_service::now_ms();
    let now = now_ms / 1000;
    match &args.command {
        Command::Nodes {
            fresh,
            state,
            prefix,
            partition,
            page_size,
        } => {
            let mut query = vec![format!("fresh={fresh}")];
            if let Some(s) = state {
                query.push(format!("state={s}"));
            }
            if let Some(p) = prefix {
                query.push(format!("prefix={}", ctl::path_segment(p)));
            }
            if let Some(p) = partition {
                query.push(format!("partition={}", ctl::path_segment(p)));
            }
            if let Some(n) = page_size {
                query.push(format!("limit={n}"));
            }
            let path = format!("/v1/nodes?{}", query.join("&"));
            let (v, nodes): (_, Vec<NodeView>) = ctl.get_pages(&path)?;
            if args.json {
                print_json(&v);
            } else {
                print!("{}", ctl::nodes_table(&nodes, now_ms));
            }
        }
        Command::Node { name } => {
            let (v, node): (_, NodeView) =
                ctl.get(&format!("/v1/nodes/{}", ctl::path_segment(name)))?;
            if args.json {
                print_json(&v);
            } else {
                print!("{}", ctl::node_detail(&node, now_ms));
            }
        }
        Command::Drain { name } | Command::Resume { name } => {
            let verb = if matches!(args.command, Command::Drain { .. }) {
                "drain"
            } else {
                "resume"
            };
            let path = format!("/v1/nodes/{}/{verb}", ctl::path_segment(name));
            let v = ctl.call("POST", &path, None)?;
            let node: NodeView = ctl::typed(&urls, &v)?;
            if args.json {
                print_json(&v);
            } else if verb == "drain" {
                println!(
                    "node {} is drained: no longer offered; its {} leased cores stay leased until their leases end",
                    node.name, node.leased_cores
                );
            } else {
                println!("node {} is offered again", node.name);
            }
        }
        Command::Leases {
            all,
            state,
            user,
            account,
            node,
            job,
            limit,
        } => {
            let mut path = format!("/v1/leases?all={all}");
            for (name, value) in [
                ("state", state),
                ("user", user),
                ("account", account),
                ("node", node),
            ] {
                if let Some(v) = value {
                    path.push_str(&format!("&{name}={}", ctl::path_segment(v)));
                }
            }
            if let Some(j) = job {
                path.push_str(&format!("&job={j}"));
            }
            let (v, leases): (_, Vec<LeaseView>) = match limit {
                Some(n) => ctl.get(&format!("{path}&limit={n}"))?,
                None => ctl.get_pages(&path)?,
            };
            if args.json {
                print_json(&v);
            } else {
                print!("{}", ctl::leases_table(&leases, now));
            }
        }
        Command::Release { grant_id } => {
            ctl.call("DELETE", &format!("/v1/leases/{grant_id}"), None)?;
            if !args.json {
                println!("grant {grant_id} released");
            }
        }
        Command::Credential(new) => {
            let body = match new {
                NewCredential::User { user, account, ttl } => {
                    let mut b = json!({"role": "user", "subject": user});
                    if let Some(a) = account {
                        b["account"] = json!(a);
                    }
                    if let Some(t) = ttl {
                        b["ttl_s"] = json!(t);
                    }
                    b
                }
                NewCredential::Node { name, ttl } => {
                    let mut b = json!({"role": "node", "subject": name});
                    if let Some(t) = ttl {
                        b["ttl_s"] = json!(t);
                    }
                    b
                }
            };
            let v = ctl.call("POST", "/v1/credentials", Some(&body))?;
            let cred: Credential = ctl::typed(&urls, &v)?;
            if args.json {
                print_json(&v);
            } else {
                let Some(token) = &cred.token else {
                    return Err(CtlError::Protocol {
                        url: urls.join(","),
                        why: "the new credential came without its token".into(),
                    });
                };
                println!("{token}");
                eprintln!("{}", ctl::credential_note(&cred, now));
            }
        }
        Command::Credentials => {
            let (v, creds): (_, Vec<Credential>) = ctl.get("/v1/credentials")?;
            if args.json {
                print_json(&v);
            } else {
                print!("{}", ctl::credentials_table(&creds, now));
            }
        }
        Command::Revoke { id } => {
            ctl.call(
                "DELETE",
                &format!("/v1/credentials/{}", ctl::path_segment(id)),
                None,
            )?;
            if !args.json {
                println!("credential {id} revoked");
            }
        }
        Command::Budget(BudgetCommand::Set { account, budget }) => {
            let path = format!("/v1/budgets/{}", ctl::path_segment(account));
            let v = ctl.call("PUT", &path, Some(&json!({ "budget": budget })))?;
            let b: BudgetView = ctl::typed(&urls, &v)?;
            if args.json {
                print_json(&v);
            } else {
                println!(
                    "account {} may spend {}; it has spent {}",
                    b.account,
                    ctl::money(b.budget),
                    ctl::money(b.spend)
                );
            }
        }
        Command::Budget(BudgetCommand::List) => {
            let (v, budgets): (_, Vec<BudgetView>) = ctl.get("/v1/budgets")?;
            if args.json {
                print_json(&v);
            } else {
                print!("{}", ctl::budgets_table(&budgets));
            }
        }
        Command::Budget(BudgetCommand::Clear { account }) => {
            let path = format!("/v1/budgets/{}", ctl::path_segment(account));
            ctl.call("DELETE", &path, None)?;
            if !args.json {
                println!("account {account} has no budget now");
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // A report piped into `head` ends quietly when the reader goes away,
    // as Unix tools do, rather than panicking on the failed write.
    // SAFETY: before any thread is started; SIG_DFL is a valid disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rfaasctl: {e}");
            ExitCode::FAILURE
        }
    }
}
