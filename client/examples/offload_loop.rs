//! A job that keeps offloading calls for a while, and moves to another
//! node when its node is taken back: the job a Slurm `--rfaas` job runs.
//!
//! It leases one core from the managers named in its environment (as a
//! `--rfaas` job finds them: `RFAAS_MANAGERS`, `RFAAS_CREDENTIAL`),
//! allocates the `echo` function there and calls it over and over, checking
//! every answer. When the node is taken back (Slurm started a job there,
//! an admin drained it, the executor stopped), the call fails with a
//! retryable status; the client library releases the lease, leases again
//! preferring other nodes, allocates there and calls again. Prints a line
//! for each node it moves to, then the calls each node served, and a JSON
//! line: `{"calls":N,"failed":F,"moves":M,"nodes":{"node2":n,...}}`.
//! `offload_loop --help` prints the usage.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{AllocationSpec, Client, ClientOptions, LeaseOptions, Mode};

const USAGE: &str = "\
Usage: offload_loop --library FILE [OPTIONS]

Leases a core from the managers in $RFAAS_MANAGERS with the credential in
$RFAAS_CREDENTIAL (a Slurm job started with --rfaas has both), calls the
`echo` function there for --seconds, and moves to another node whenever
its node is taken back. Exits 0 when every call was answered correctly.

Options:
  --library FILE     the function library (it must export `echo`, as
                     librfaas_example_functions.so does)
  --provider NAME    fabric provider: tcp, shm (same machine only) or
                     verbs:DEVICE [default: tcp]
  --seconds S        how long to keep calling [default: 10]
  --pause-ms MS      pause between calls [default: 1]
  --bytes N          payload of each call [default: 4096]
  --hot              busy-poll for calls (hot); default: warm (blocking)
  -h, --help         print this help
";

struct Args {
    library: String,
    provider: String,
    seconds: u64,
    pause_ms: u64,
    bytes: usize,
    hot: bool,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        library: String::new(),
        provider: "tcp".into(),
        seconds: 10,
        pause_ms: 1,
        bytes: 4096,
        hot: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--library" => args.library = value()?,
            "--provider" => args.provider = value()?,
            "--seconds" => args.seconds = number(value()?)?,
            "--pause-ms" => args.pause_ms = number(value()?)?,
            "--bytes" => args.bytes = number(value()?)? as usize,
            "--hot" => args.hot = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.library.is_empty() {
        return Err("--library is required".into());
    }
    if args.bytes == 0 || args.bytes > 1 << 20 {
        return Err(format!("--bytes {}: give 1 to 1048576", args.bytes));
    }
    Ok(Some(args))
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => {
            print!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("offload_loop: {e}\n(`offload_loop --help` prints the usage)");
            return std::process::ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("offload_loop: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let library = std::fs::read(&args.library)
        .map_err(|e| format!("cannot read the library {}: {e}", args.library))?;
    let managers = Managers::from_env()?;
    let client = Client::new(ClientOptions::with_provider(&args.provider));
    let size = (args.bytes as u32).next_multiple_of(4096);
    let spec = AllocationSpec::new(library, &["echo"])
        .cores(1)
        .memory_mib(256)
        .mode(if args.hot { Mode::Hot } else { Mode::Warm })
        .input_capacity(size)
        .output_capacity(size);
    let request = LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s: 60,
        min_cores: None,
        nodes: Vec::new(),
    };
    let options = LeaseOptions::default().retry_elsewhere(true);
    let mut alloc = managers.allocate(&client, &request, &spec, &options)?;
    let echo = alloc.function("echo")?;
    let mut input = alloc.buffer::<u8>(args.bytes)?;
    let mut output = alloc.buffer::<u8>(args.bytes)?;
    // The buffers are copied to and from, never viewed in place: the
    // worker keeps their keys (Buffer's "Reading and writing").
    let (mut sent, mut echoed) = (vec![0u8; args.bytes], vec![0u8; args.bytes]);
    let mut node = alloc.node();
    println!("calling echo on {node} ({} bytes a call)", args.bytes);
    let (mut calls, mut failed, mut moves) = (0u64, 0u64, 0u64);
    let mut per_node: BTreeMap<String, u64> = BTreeMap::new();
    let until = Instant::now() + Duration::from_secs(args.seconds);
    while Instant::now() < until {
        let stamp = calls.to_le_bytes();
        for (i, b) in sent.iter_mut().enumerate() {
            *b = stamp[i % 8] ^ (i as u8);
        }
        input.write_from(0, &sent);
        let answered = alloc.invoke_retrying(echo, &input, args.bytes, &mut output, 5);
        if answered.is_ok() {
            output.read_into(0, &mut echoed);
        }
        match answered {
            Ok(n) if n == args.bytes && echoed == sent => {
                calls += 1;
                let now_on = alloc.node();
                if now_on != node {
                    moves += 1;
                    println!("moved from {node} to {now_on} after {calls} calls");
                    node = now_on;
                }
                *per_node.entry(node.clone()).or_default() += 1;
            }
            Ok(n) => {
                failed += 1;
                eprintln!("offload_loop: call {calls} on {node} answered {n} bytes, not the echo");
            }
            Err(e) => {
                failed += 1;
                eprintln!("offload_loop: call {calls} on {node} failed: {e}");
                break;
            }
        }
        if args.pause_ms > 0 {
            std::thread::sleep(Duration::from_millis(args.pause_ms));
        }
    }
    alloc.deallocate()?;
    for (n, c) in &per_node {
        println!("{n}: {c} calls");
    }
    let nodes: Vec<String> = per_node.iter().map(|(n, c)| format!("{n:?}:{c}")).collect();
    println!(
        "{{\"calls\":{calls},\"failed\":{failed},\"moves\":{moves},\"nodes\":{{{}}}}}",
        nodes.join(",")
    );
    Ok(failed == 0 && calls > 0)
}
