//! `rfaas-token`: makes the cluster secret and mints or checks lease tokens
//! by hand (for tests, demos and debugging; the manager mints them in
//! production).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Parser, Subcommand};
use rfaas_executor::daemon::secret::{generate_secret, read_secret};
use rfaas_proto::lease::{self, LeaseClaims};

/// Makes the cluster secret, and mints or checks lease tokens by hand.
///
/// An rfaas-executord accepts an allocation only with a lease token for its
/// node, signed with the secret in its --secret-file. Until the rfaas
/// manager hands out leases, mint them here, on a machine that holds the
/// secret, and give the token to the job.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prints a lease token for the given claims, signed with the secret.
    Mint {
        /// The cluster secret's file.
        #[arg(long)]
        secret_file: PathBuf,
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
        /// The lease's id (default: derived from the clock).
        #[arg(long)]
        lease_id: Option<u64>,
    },
    /// Checks a token's signature, expiry and node; prints its claims as
    /// JSON, or the reason it is refused (exit code 1).
    Verify {
        /// The cluster secret's file.
        #[arg(long)]
        secret_file: PathBuf,
        /// The node checking the token (as its executor's node_name).
        #[arg(long)]
        node: String,
        /// The token.
        token: String,
    },
    /// Writes 48 random bytes to a new file with mode 0600.
    GenSecret {
        /// The file to create; an existing file is never overwritten.
        file: PathBuf,
    },
}

fn now() -> anyhow::Result<u64> {
    Ok(SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the system clock is before 1970")?
        .as_secs())
}

fn main() -> anyhow::Result<ExitCode> {
    match Args::parse().command {
        Command::Mint {
            secret_file,
            node,
            user,
            account,
            cores,
            memory_mib,
            ttl_secs,
            job_id,
            lease_id,
        } => {
            let secret = read_secret(&secret_file)?;
            let now = now()?;
            let lease_id = match lease_id {
                Some(id) => id,
                None => SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .context("the system clock is before 1970")?
                    .as_nanos() as u64,
            };
            let claims = LeaseClaims {
                lease_id,
                node,
                user,
                account,
                job_id,
                cores,
                memory_mib,
                issued_at: now,
                expires_at: now.saturating_add(ttl_secs),
            };
            println!("{}", claims.sign(&secret)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify {
            secret_file,
            node,
            token,
        } => {
            let secret = read_secret(&secret_file)?;
            match lease::verify(&token, &secret, now()?, &node) {
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
        Command::GenSecret { file } => {
            generate_secret(&file, 48)
                .with_context(|| format!("cannot write a new secret to {}", file.display()))?;
            eprintln!("wrote 48 random bytes to {} (mode 0600)", file.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}
