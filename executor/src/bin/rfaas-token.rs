//! `rfaas-token`: makes lease signing keys and mints or checks lease tokens
//! by hand (for tests, demos and debugging; the manager mints them in
//! production).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Parser, Subcommand};
use rfaas_proto::files::{ConfigDir, LEASE_KEYS_PUB, LEASE_KEY_SECRET};
use rfaas_proto::lease::{LeaseClaims, LeaseSigner};
use rfaas_tls::keys::{read_lease_keys, read_secret_key, write_key_pair};

/// Makes lease signing keys, and mints or checks lease tokens by hand.
///
/// An rfaas-executord runs a function only for a job that shows a lease
/// token: a lease for that node, signed with a key whose public half is in
/// the executor's lease_keys files. The rfaas manager signs them. Without a
/// manager, make a key pair once with `keygen`, keep the secret file on one
/// trusted machine, copy the public file to every node, and mint tokens
/// there with `mint`.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The configuration directory, where the key files are by default
    /// [env: RFAAS_CONFIG_DIR] [default: /etc/rfaas].
    #[arg(long, value_name = "DIR", global = true)]
    config_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Makes a new signing key: a secret file (mode 0600: whoever reads it
    /// can mint leases) and a public file for the executors' lease_keys.
    Keygen {
        /// A name for the key, written into every token it signs: use a new
        /// one for each new key (e.g. site-2025-01), so executors can accept
        /// the old and the new key for a while.
        #[arg(long)]
        key_id: String,
        /// Where to write the secret key; an existing file is never
        /// overwritten [default: lease-key.secret in the configuration
        /// directory, where the manager reads it].
        #[arg(long, value_name = "FILE")]
        secret: Option<PathBuf>,
        /// Where to write the public key; copy it to every node [default:
        /// lease-keys.pub in the configuration directory, where executord
        /// reads it].
        #[arg(long, value_name = "FILE")]
        public: Option<PathBuf>,
    },
    /// Prints a lease token for the given claims, signed with a secret key.
    Mint {
        /// The secret key file (from `keygen`) [default: lease-key.secret
        /// in the configuration directory].
        #[arg(long, value_name = "FILE")]
        key: Option<PathBuf>,
        /// The node the lease is for: its executor's node_name.
        #[arg(long)]
        node: String,
        /// The user the workers run as: a user that exists on that node, not
        /// root.
        #[arg(long)]
        user: String,
        /// The account charged.
        #[arg(long)]
        account: String,
        /// Cores granted: allocations under this lease hold at most as many
        /// lanes in all.
        #[arg(long)]
        cores: u16,
        /// Memory granted, MiB, across the lease's allocations.
        #[arg(long)]
        memory_mib: u32,
        /// Seconds from now until the lease ends (and its workers with it).
        #[arg(long)]
        ttl_secs: u64,
        /// The Slurm job the lease serves.
        #[arg(long)]
        job_id: Option<u64>,
        /// The lease's id (default: derived from the clock). Give the same
        /// id again to mint a renewal of a running lease with a later end.
        #[arg(long)]
        lease_id: Option<u64>,
    },
    /// Checks a token as an executor would: signature, expiry and node.
    /// Prints its claims as JSON, or why it is refused (exit code 1).
    Verify {
        /// A public key file, as in the executor's lease_keys; give it again
        /// for more files [default: lease-keys.pub in the configuration
        /// directory].
        #[arg(long, value_name = "FILE")]
        keys: Vec<PathBuf>,
        /// The node checking the token (as its executor's node_name).
        #[arg(long)]
        node: String,
        /// The token.
        token: String,
    },
}

fn now() -> anyhow::Result<u64> {
    Ok(SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the system clock is before 1970")?
        .as_secs())
}

fn main() -> anyhow::Result<ExitCode> {
    // A report piped into `head` ends quietly when the reader goes away,
    // as Unix tools do, rather than panicking on the failed write.
    // SAFETY: before any thread is started; SIG_DFL is a valid disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let args = Args::parse();
    let dir = ConfigDir::resolve(args.config_dir.as_deref());
    let in_dir = |given: Option<PathBuf>, name: &str| given.unwrap_or_else(|| dir.file(name));
    match args.command {
        Command::Keygen {
            key_id,
            secret,
            public,
        } => {
            let secret = in_dir(secret, LEASE_KEY_SECRET);
            let public = in_dir(public, LEASE_KEYS_PUB);
            let signer = LeaseSigner::generate(&key_id)?;
            write_key_pair(&signer, &secret, &public)?;
            eprintln!(
                "wrote the secret key {key_id:?} to {} (mode 0600; keep it private) and its public key to {} (copy it to every node's lease_keys)",
                secret.display(),
                public.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Mint {
            key,
            node,
            user,
            account,
            cores,
            memory_mib,
            ttl_secs,
            job_id,
            lease_id,
        } => {
            let signer = read_secret_key(&in_dir(key, LEASE_KEY_SECRET))
                .map_err(|e| anyhow::anyhow!("{e}; {}", dir.hint(&["--key"])))?;
            let now = now()?;
            let lease_id = match lease_id {
                Some(id) => id,
                None => SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .context("the system clock is before 1970")?
                    .as_nanos() as u64,
            };
            let claims = LeaseClaims {
                key_id: signer.key_id().to_owned(),
                lease_id,
                node,
                user,
                account,
                job_id,
                cores,
                memory_mib,
                issued_at: now,
                expires_at: now.saturating_add(ttl_secs),
                billing: None,
            };
            println!("{}", signer.sign(&claims));
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { keys, node, token } => {
            let keys = if keys.is_empty() {
                vec![dir.file(LEASE_KEYS_PUB)]
            } else {
                keys
            };
            let keys = read_lease_keys(&keys)
                .map_err(|e| anyhow::anyhow!("{e}; {}", dir.hint(&["--keys"])))?;
            match keys.verify(&token, now()?, &node) {
                Ok(claims) => {
                    println!("{}", serde_json::to_string_pretty(&claims)?);
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprintln!("rfaas-token: refused ({}): {e}", e.kind());
                    Ok(ExitCode::from(1))
                }
            }
        }
    }
}
