//! What the two binaries share around their own `Args`: CPU pinning, the
//! [`Ctx`] built from the flags, the `--serve` dispatch, and the rounds;
//! and, for the single-purpose benches, the service binary they run
//! ([`service_binary`]).

use std::process::ExitCode;

use clap::ValueEnum;

use crate::child;
use crate::error::{Context, Error, Result};
use crate::report::{Report, Row};
use crate::rows::{self, Ctx, Provider, Suite};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pin {
    Auto,
    On,
    Off,
}

/// The flags both binaries have; each flattens this into its own `Args`.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// Providers to measure: tcp, shm, verbs:DEVICE; repeat the flag or
    /// separate with commas. Baselines run for the providers they stand for.
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    pub provider: Vec<String>,

    /// Payload sizes in bytes for latency rows.
    #[arg(long, value_delimiter = ',', default_value = "1,64,1024,4096")]
    pub sizes: Vec<usize>,

    /// Payload sizes in bytes for bandwidth rows.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,65536,1048576,5242880"
    )]
    pub bw_sizes: Vec<usize>,

    /// Timed iterations per latency row, after max(1000, iters/10) untimed.
    #[arg(long, default_value_t = 10_000)]
    pub iters: usize,

    /// Bytes moved per bandwidth row (at least 8 messages; an echo counts
    /// both directions).
    #[arg(long, default_value_t = 256 << 20)]
    pub bw_bytes: u64,

    /// Measure every row this many times and report each row's best round:
    /// on a shared machine a slow round says more about the neighbours than
    /// about the code.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,

    /// Only these rows (comma-separated names, listed by --help); all when
    /// absent.
    #[arg(long, value_delimiter = ',')]
    pub rows: Option<Vec<String>>,

    /// Print one JSON object per row on stdout; the table goes to stderr.
    #[arg(long)]
    pub json: bool,

    /// Pin the bench to one CPU and its peers (and an executor daemon with
    /// its workers) to another. `auto` pins when at least two CPUs are
    /// available.
    #[arg(long, value_enum, default_value_t = Pin::Auto, num_args = 0..=1, default_missing_value = "on")]
    pub cpu_pin: Pin,

    /// Internal: run the peer side `<what>` of a row (see child.rs).
    #[arg(long, hide = true, num_args = 1.., allow_hyphen_values = true, value_name = "WHAT")]
    pub serve: Option<Vec<String>>,
}

/// Checks the flags and decides where the bench and its peers run.
pub fn context(args: &Common, invoke: crate::invoke::Settings) -> Result<Ctx> {
    let providers = args
        .provider
        .iter()
        .map(|p| Provider::parse(p))
        .collect::<Result<Vec<_>>>()?;
    for (flag, sizes) in [("--sizes", &args.sizes), ("--bw-sizes", &args.bw_sizes)] {
        if sizes.contains(&0) {
            return Err(Error::new(format!(
                "{flag} must list sizes of at least 1 byte"
            )));
        }
    }
    let (cpu, peer_cpu) = match args.cpu_pin {
        Pin::Off => (None, None),
        pin => match child::allowed_cpus()?[..] {
            [a, b, ..] => (Some(a), Some(b)),
            _ if pin == Pin::On => {
                return Err(Error::new(
                    "--cpu-pin needs at least two CPUs and this process may use only one",
                ))
            }
            _ => (None, None),
        },
    };
    Ok(Ctx {
        providers,
        sizes: args.sizes.clone(),
        bw_sizes: args.bw_sizes.clone(),
        iters: args.iters,
        warmup: (args.iters / 10).max(1000),
        bw_bytes: args.bw_bytes,
        cpu,
        peer_cpu,
        invoke,
    })
}

/// The end of a binary's `--help`: every row of `suites` with what it
/// measures, then the `derived` rows (name, what), then how to read them.
pub fn rows_help(suites: &[Suite], derived: &[(&str, &str)]) -> String {
    let mut out = String::from("Rows (every one unless --rows names some):\n");
    push_list(
        &mut out,
        suites.iter().flat_map(|s| s.rows).map(|r| (r.name, r.help)),
    );
    if !derived.is_empty() {
        out.push_str("\nComputed at the end from the best round of two measured rows:\n");
        push_list(&mut out, derived.iter().copied());
    }
    out.push('\n');
    push_wrapped(
        &mut out,
        String::new(),
        "Latency rows print the median and p99 round trip in µs, bandwidth rows bytes per \
         second. Each row's peer runs as a child process of the bench (pinned to another CPU \
         with --cpu-pin) and is stopped by its pid. Figures, targets and how to read them: \
         docs/benchmarks.md in the rfaas repository.",
        0,
    );
    out
}

/// Appends `rows` as an indented list of names and wrapped descriptions.
fn push_list<'a>(out: &mut String, rows: impl Iterator<Item = (&'a str, &'a str)>) {
    const NAME: usize = 28;
    for (name, help) in rows {
        let mut first = format!("  {name:<NAME$} ");
        if first.len() > NAME + 3 {
            out.push_str(first.trim_end());
            out.push('\n');
            first = " ".repeat(NAME + 3);
        }
        push_wrapped(out, first, help, NAME + 3);
    }
}

/// Appends `text` to `line` word by word, starting a new line indented by
/// `indent` spaces wherever the next word would pass column 100.
fn push_wrapped(out: &mut String, mut line: String, text: &str, indent: usize) {
    let mut empty = true;
    for word in text.split(' ') {
        if !empty && line.chars().count() + 1 + word.chars().count() > 100 {
            out.push_str(&line);
            out.push('\n');
            line = " ".repeat(indent);
            empty = true;
        }
        if !empty {
            line.push(' ');
        }
        line.push_str(word);
        empty = false;
    }
    out.push_str(&line);
    out.push('\n');
}

/// Every peer entry point of `suites`.
pub fn peers(suites: &[Suite]) -> Vec<child::PeerSpec> {
    suites
        .iter()
        .flat_map(|s| s.peers.iter().copied())
        .collect()
}

/// The body of a binary's `main`: serves a peer when started with
/// `--serve <what> <args>...`; otherwise builds the [`Ctx`] with `invoke`,
/// runs the rows `rounds` times and prints each row's best round, then the
/// rows `derive` makes from them. An error becomes one line on stderr and a
/// failing exit code.
pub fn main(
    bin: &str,
    suites: &[Suite],
    args: &Common,
    invoke: impl FnOnce() -> Result<crate::invoke::Settings>,
    derive: impl Fn(&[Row]) -> Vec<Row>,
) -> ExitCode {
    let result = match &args.serve {
        Some(serve) => match serve.split_first() {
            Some((what, rest)) => child::serve(&peers(suites), what, rest)
                .map_err(|e| Error::new(format!("the {what} peer process stopped: {e}"))),
            None => Err(Error::new("--serve needs the name of a peer")),
        },
        None => invoke()
            .and_then(|invoke| context(args, invoke))
            .and_then(|ctx| run_rounds(suites, args, &ctx, derive)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{bin}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Checks that no two rows and no two peers of `suites` share a name and
/// that every row says what it measures (each binary's tests call it).
pub fn check_unique_names(suites: &[Suite]) {
    for row in suites.iter().flat_map(|s| s.rows) {
        assert!(!row.help.is_empty(), "row {} has no --help line", row.name);
    }
    let mut rows: Vec<&str> = suites.iter().flat_map(|s| s.rows).map(|r| r.name).collect();
    let mut peers: Vec<&str> = peers(suites).iter().map(|p| p.name).collect();
    for names in [&mut rows, &mut peers] {
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate names: {names:?}");
    }
}

/// Pins the bench, runs the selected rows `rounds` times, prints each row's
/// best round (see report.rs), then the rows `derive` makes from them.
fn run_rounds(
    suites: &[Suite],
    args: &Common,
    ctx: &Ctx,
    derive: impl Fn(&[Row]) -> Vec<Row>,
) -> Result<()> {
    let filter = args.rows.as_deref();
    let rounds = args.rounds as usize;
    if let Some(filter) = filter {
        rows::check_filter(suites, filter)?;
    }
    if let Some(cpu) = ctx.cpu {
        child::pin_current_thread(cpu).context(|| {
            format!("could not pin the bench to CPU {cpu} (--cpu-pin off skips pinning)")
        })?;
    }
    let mut report = Report::new(args.json, rounds);
    for round in 1..=rounds {
        if rounds > 1 {
            eprintln!("round {round} of {rounds}");
        }
        report.start_round();
        rows::run(suites, filter, ctx, &mut report)?;
    }
    report.finish_with(derive)
}

/// The service binary `name` a bench runs: `given` (its flag), or the one
/// next to the bench's own executable, built from `package`.
pub fn service_binary(
    given: Option<&std::path::Path>,
    name: &str,
    package: &str,
    flag: &str,
) -> std::result::Result<std::path::PathBuf, String> {
    let bin = match given {
        Some(b) => b.to_owned(),
        None => std::env::current_exe()
            .map_err(|e| format!("could not find the bench's own executable: {e}"))?
            .with_file_name(name),
    };
    if !bin.exists() {
        return Err(format!(
            "{} does not exist: build it next to the bench (cargo build --release -p \
             {package} -p rfaas-bench) or pass {flag}",
            bin.display()
        ));
    }
    Ok(bin)
}
