//! `rfaas-fabric-probe`: checks the fabric between two processes or nodes.
//!
//! - `serve` exposes one region (all remote rights) and accepts connections
//!   without ever polling its completion queue: a passive target, like a
//!   NIC-backed region. It prints one line `ready <addr> <region-addr> <rkey>
//!   <len>` and runs until killed.
//! - `faa` connects to a `serve` and adds 1 to the word at the region's start
//!   `--count` times, checking every completion.
//! - `pingpong` runs a write-with-immediate ping-pong against `serve --echo`.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rfaas_fabric::{Access, Completion, EndpointOptions, Fabric, Opcode, RemoteAddr};

#[derive(Parser)]
#[command(
    version,
    about = "Checks the rfaas fabric between two processes or nodes"
)]
struct Args {
    /// Fabric provider: `tcp`, `shm` or `verbs:<device>`.
    #[arg(long, default_value = "tcp")]
    provider: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Expose a region and serve connections passively.
    Serve {
        /// Address to listen on (port 0 picks one; empty for shm picks a name).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Region size in bytes.
        #[arg(long, default_value_t = 4096)]
        len: usize,
        /// Answer every write-with-immediate with one of the same length (actively polling).
        #[arg(long)]
        echo: bool,
    },
    /// Fetch-and-add 1 to the first word of a served region, `count` times.
    Faa {
        #[arg(long)]
        connect: String,
        #[arg(long)]
        addr: u64,
        #[arg(long)]
        rkey: u32,
        #[arg(long, default_value_t = 1000)]
        count: u64,
    },
    /// Round trips of write-with-immediate against `serve --echo`.
    Pingpong {
        #[arg(long)]
        connect: String,
        #[arg(long)]
        addr: u64,
        #[arg(long)]
        rkey: u32,
        #[arg(long, default_value_t = 64)]
        size: usize,
        #[arg(long, default_value_t = 10000)]
        iters: u64,
    },
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    // The fabric reports connection failures through `tracing`.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("rfaas-fabric-probe: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Res<()> {
    let fabric = Fabric::open(&args.provider)?;
    match args.cmd {
        Cmd::Serve { listen, len, echo } => serve(&fabric, &listen, len, echo),
        Cmd::Faa {
            connect,
            addr,
            rkey,
            count,
        } => faa(&fabric, &connect, RemoteAddr { addr, rkey }, count),
        Cmd::Pingpong {
            connect,
            addr,
            rkey,
            size,
            iters,
        } => pingpong(&fabric, &connect, RemoteAddr { addr, rkey }, size, iters),
    }
}

fn serve(fabric: &Fabric, listen: &str, len: usize, echo: bool) -> Res<()> {
    let domain = fabric.domain()?;
    let region = domain.register(len, Access::ALL)?;
    let listener = fabric.listen(listen)?;
    let d = region.descriptor();
    println!(
        "ready {} {} {} {}",
        listener.local_addr(),
        d.addr,
        d.rkey,
        d.len
    );
    std::io::stdout().flush()?;
    let opts = EndpointOptions::default();
    if echo {
        // One client at a time; a client leaving ends only its session.
        loop {
            let mut cq = fabric.completion_queue(1024)?;
            let ep = listener.accept(&domain, &mut cq, &opts, None)?;
            match echo_session(&ep, &mut cq, &region) {
                Ok(()) => {}
                Err(e) => eprintln!(
                    "rfaas-fabric-probe: session with {} failed: {e}",
                    ep.peer_addr()
                ),
            }
        }
    }
    // Passive: accept connections forever, never poll.
    let mut cqs = Vec::new();
    let mut eps = Vec::new();
    loop {
        let mut cq = fabric.completion_queue(1024)?;
        let ep = listener.accept(&domain, &mut cq, &opts, None)?;
        cqs.push(cq);
        eps.push(ep);
    }
}

/// Answers every write-with-immediate with one of the same length, into
/// the region whose descriptor the client wrote into our first 12 bytes.
fn echo_session(
    ep: &rfaas_fabric::Endpoint,
    cq: &mut rfaas_fabric::CompletionQueue,
    region: &rfaas_fabric::MemoryRegion,
) -> Res<()> {
    for i in 0..64 {
        ep.post_recv(i)?;
    }
    let mut done = [Completion::EMPTY; 16];
    loop {
        let n = cq.poll(&mut done);
        for c in &done[..n] {
            if c.status == rfaas_fabric::Status::PeerLost {
                // The client left.
                return Ok(());
            }
            if !c.status.is_ok() {
                return Err(format!("{:?} completed with {}", c.opcode, c.status).into());
            }
            if c.opcode == Opcode::RecvWithImm {
                ep.post_recv(c.wr_id)?;
                let bytes = region.as_slice();
                let addr = u64::from_le_bytes(bytes[..8].try_into()?);
                let rkey = u32::from_le_bytes(bytes[8..12].try_into()?);
                ep.write_with_imm(
                    0,
                    region,
                    0,
                    c.byte_len as usize,
                    RemoteAddr { addr, rkey },
                    c.imm,
                )?;
            }
        }
    }
}

fn wait_one(cq: &mut rfaas_fabric::CompletionQueue, what: &str) -> Res<Completion> {
    let mut done = [Completion::EMPTY; 1];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if cq.poll(&mut done) == 1 {
            if !done[0].status.is_ok() {
                return Err(format!("{what} failed: {}", done[0].status).into());
            }
            return Ok(done[0]);
        }
        if Instant::now() > deadline {
            return Err(format!("{what} did not complete within 30 s").into());
        }
    }
}

fn faa(fabric: &Fabric, connect: &str, remote: RemoteAddr, count: u64) -> Res<()> {
    let domain = fabric.domain()?;
    let mut cq = fabric.completion_queue(1024)?;
    let ep = domain.connect(connect, &mut cq, &EndpointOptions::default())?;
    let local = domain.register(8, Access::LOCAL)?;
    for i in 0..count {
        ep.fetch_add(i, &local, 0, remote, 1)?;
        let c = wait_one(&mut cq, "fetch-and-add")?;
        if c.opcode != Opcode::FetchAdd || c.wr_id != i {
            return Err(format!("unexpected completion {c:?}").into());
        }
    }
    println!("done {count}");
    Ok(())
}

fn pingpong(
    fabric: &Fabric,
    connect: &str,
    remote: RemoteAddr,
    size: usize,
    iters: u64,
) -> Res<()> {
    let domain = fabric.domain()?;
    let mut cq = fabric.completion_queue(1024)?;
    let ep = domain.connect(connect, &mut cq, &EndpointOptions::default())?;
    let mut local = domain.register(size.max(16), Access::REMOTE_WRITE)?;
    let d = local.descriptor();
    local.as_mut_slice()[..8].copy_from_slice(&d.addr.to_le_bytes());
    local.as_mut_slice()[8..12].copy_from_slice(&d.rkey.to_le_bytes());
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..iters {
        ep.post_recv(i)?;
        let start = Instant::now();
        ep.write_with_imm(i, &local, 0, size.max(16), remote, i as u32)?;
        let mut got_reply = false;
        let mut got_send = false;
        let mut done = [Completion::EMPTY; 4];
        while !(got_reply && got_send) {
            let n = cq.poll(&mut done);
            for c in &done[..n] {
                if !c.status.is_ok() {
                    return Err(format!("completion failed: {}", c.status).into());
                }
                match c.opcode {
                    Opcode::RecvWithImm => got_reply = true,
                    _ => got_send = true,
                }
            }
        }
        samples.push(start.elapsed().as_nanos() as u64);
    }
    samples.sort_unstable();
    let median = samples[samples.len() / 2];
    let p99 = samples[samples.len() * 99 / 100];
    println!(
        "{} pingpong {} B x {iters}: median {:.2} us, p99 {:.2} us",
        fabric.provider(),
        size.max(16),
        median as f64 / 1e3,
        p99 as f64 / 1e3
    );
    Ok(())
}
