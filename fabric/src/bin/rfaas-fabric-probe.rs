//! `rfaas-fabric-probe`: checks the fabric between two processes or nodes.
//!
//! - `serve` exposes one region (all remote rights) and accepts connections
//!   without ever polling its completion queue: a passive target, like a
//!   NIC-backed region. It prints one line `rfaas-fabric-probe ready
//!   provider=<p> listen=<addr> addr=<region-addr> rkey=<rkey> len=<len>` and
//!   runs until killed.
//! - `faa` connects to a `serve` and adds 1 to the word at the region's start
//!   `--count` times, checking every completion.
//! - `pingpong` runs a write-with-immediate ping-pong against `serve --echo`.
//! - `check` verifies a connection to `serve --echo` operation by operation
//!   (write-with-immediate both ways, read, fetch-and-add, compare-and-swap,
//!   each checked byte for byte), and with `--await-peer-loss` then waits
//!   until the peer is lost, probing it with a fetch-and-add every 100 ms.
//!   Against a plain `serve`, `--no-echo` skips the write-with-immediate.
//!   Used across two VMs by `scripts/test-verbs-two-node.sh`.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rfaas_fabric::{Access, Completion, EndpointOptions, Fabric, Opcode, RemoteAddr};

/// Checks the rfaas fabric between two processes or nodes.
///
/// Start `serve` on one side; it prints where it listens and the region it
/// exposes. Give those to `check`, `pingpong` or `faa` on the other side.
/// Exits 0 when every check passed, 1 with a sentence on stderr otherwise.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Fabric provider: `tcp`, `shm` (same machine) or `verbs:<device>`
    /// (e.g. `verbs:mlx5_0`; `ibv_devices` lists them). Both sides must use
    /// the same.
    #[arg(long, default_value = "tcp")]
    provider: String,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Where a client finds a `serve`: the values of its ready line.
#[derive(clap::Args)]
struct Target {
    /// The address `serve` listens on: its ready line's `listen=` (host:port
    /// for tcp and verbs, a socket name for shm).
    #[arg(long, value_name = "ADDRESS")]
    connect: String,
    /// The served region's address: the ready line's `addr=`.
    #[arg(long)]
    addr: u64,
    /// The served region's remote key: the ready line's `rkey=`.
    #[arg(long)]
    rkey: u32,
}

#[derive(Subcommand)]
enum Cmd {
    /// Expose a region and serve connections passively.
    ///
    /// Prints one line on stdout once it listens, `rfaas-fabric-probe ready
    /// provider=<provider> listen=<address> addr=<region address>
    /// rkey=<remote key> len=<bytes>`, then serves until killed. Without
    /// --echo it never polls: remote operations complete without its help,
    /// as on an RDMA NIC.
    Serve {
        /// Address to listen on: host:port (port 0 picks a free one) for tcp
        /// and verbs; for shm a socket name, empty to pick one.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Region size in bytes.
        #[arg(long, default_value_t = 4096)]
        len: usize,
        /// Answer every write-with-immediate with one of the same length
        /// (polling actively), as `check` and `pingpong` expect.
        #[arg(long)]
        echo: bool,
    },
    /// Fetch-and-add 1 to the first word of a served region, --count times.
    Faa {
        #[command(flatten)]
        target: Target,
        /// Fetch-and-adds to make.
        #[arg(long, default_value_t = 1000)]
        count: u64,
    },
    /// Measure write-with-immediate round trips against `serve --echo`.
    Pingpong {
        #[command(flatten)]
        target: Target,
        /// Bytes per message (at least 16: the first 12 tell the echo where
        /// to answer).
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Round trips to measure.
        #[arg(long, default_value_t = 10000)]
        iters: u64,
    },
    /// Verify every operation against `serve --echo`, byte for byte.
    ///
    /// Write-with-immediate there and back, read, fetch-and-add and
    /// compare-and-swap, one line each. Against a plain `serve`, give
    /// --no-echo: a plain write then stands in for the write-with-immediate.
    Check {
        #[command(flatten)]
        target: Target,
        /// Length of the served region: the ready line's `len=`.
        #[arg(long, default_value_t = 4096)]
        len: usize,
        /// The peer is a plain `serve`: no write-with-immediate echo.
        #[arg(long)]
        no_echo: bool,
        /// After the checks, wait up to this many seconds for the peer to be
        /// lost (killed, or its machine gone), and fail if it is not.
        #[arg(long, value_name = "SECONDS")]
        await_peer_loss: Option<u64>,
    },
}

impl Target {
    fn remote(&self) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr,
            rkey: self.rkey,
        }
    }
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
        Cmd::Faa { target, count } => faa(&fabric, &target.connect, target.remote(), count),
        Cmd::Pingpong {
            target,
            size,
            iters,
        } => pingpong(&fabric, &target.connect, target.remote(), size, iters),
        Cmd::Check {
            target,
            len,
            no_echo,
            await_peer_loss,
        } => check(
            &fabric,
            &target.connect,
            target.remote(),
            len,
            !no_echo,
            await_peer_loss.map(Duration::from_secs),
        ),
    }
}

fn serve(fabric: &Fabric, listen: &str, len: usize, echo: bool) -> Res<()> {
    let domain = fabric.domain()?;
    let region = domain.register(len, Access::ALL)?;
    let listener = fabric.listen(listen)?;
    let d = region.descriptor();
    println!(
        "rfaas-fabric-probe ready provider={} listen={} addr={} rkey={} len={}",
        fabric.provider(),
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
                let mut bytes = [0; 12];
                region.read_into(0, &mut bytes);
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
    local.write_from(0, &d.addr.to_le_bytes());
    local.write_from(8, &d.rkey.to_le_bytes());
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

/// Waits for the next completion and checks that it is `want` of `wr_id`
/// and succeeded.
fn expect(
    cq: &mut rfaas_fabric::CompletionQueue,
    what: &str,
    wr_id: u64,
    want: Opcode,
) -> Res<Completion> {
    let c = wait_one(cq, what)?;
    if (c.wr_id, c.opcode) != (wr_id, want) {
        return Err(format!("{what}: expected {want:?} of request {wr_id}, got {c:?}").into());
    }
    Ok(c)
}

fn check(
    fabric: &Fabric,
    connect: &str,
    remote: RemoteAddr,
    len: usize,
    echo: bool,
    await_peer_loss: Option<Duration>,
) -> Res<()> {
    // The served region: [0, half) carries data, its last word the counter.
    if len < 64 || len % 8 != 0 {
        return Err(format!(
            "--len {len}: the served region must be a multiple of 8, at least 64 B"
        )
        .into());
    }
    let half = len / 2;
    let counter = remote.addr + (len - 8) as u64;
    let at = |offset: usize| RemoteAddr {
        addr: remote.addr + offset as u64,
        rkey: remote.rkey,
    };
    let domain = fabric.domain()?;
    let mut cq = fabric.completion_queue(1024)?;
    let start = Instant::now();
    let ep = domain.connect(connect, &mut cq, &EndpointOptions::default())?;
    println!(
        "connect: ok, {} in {:.1} ms",
        ep.peer_addr(),
        start.elapsed().as_secs_f64() * 1e3
    );

    let mut sent = domain.register(half, Access::LOCAL)?;
    let echoed = domain.register(half, Access::REMOTE_WRITE)?;
    let readback = domain.register(half, Access::LOCAL)?;
    // What `serve --echo` expects first: where to write its answer.
    let d = echoed.descriptor();
    let mut pattern: Vec<u8> = (0..half)
        .map(|i| (i.wrapping_sub(12) as u8).wrapping_mul(29).wrapping_add(7))
        .collect();
    pattern[..8].copy_from_slice(&d.addr.to_le_bytes());
    pattern[8..12].copy_from_slice(&d.rkey.to_le_bytes());
    sent.write_from(0, &pattern);

    if echo {
        ep.post_recv(1)?;
        let imm = 0x5EED_0001;
        ep.write_with_imm(2, &sent, 0, half, at(0), imm)?;
        let mut got_recv = None;
        let mut got_send = false;
        while got_recv.is_none() || !got_send {
            let c = wait_one(&mut cq, "write-with-immediate")?;
            match c.opcode {
                Opcode::RecvWithImm => got_recv = Some(c),
                Opcode::WriteWithImm => got_send = true,
                other => return Err(format!("unexpected {other:?} completion: {c:?}").into()),
            }
        }
        let answer = got_recv.expect("loop ends with it");
        if (answer.imm, answer.byte_len as usize) != (imm, half) {
            return Err(format!(
                "the echo came back with immediate {:#x} and {} B, not {imm:#x} and {half} B",
                answer.imm, answer.byte_len
            )
            .into());
        }
        if echoed.read_to_vec(..) != pattern {
            return Err("the echoed bytes differ from the bytes written".into());
        }
        println!("write-with-immediate: ok, {half} B and immediate {imm:#x} there and back");
    } else {
        ep.write(2, &sent, 0, half, at(0))?;
        expect(&mut cq, "write", 2, Opcode::Write)?;
        println!("write: ok, {half} B");
    }

    ep.read(3, &readback, 0, half, at(0))?;
    let c = expect(&mut cq, "read", 3, Opcode::Read)?;
    if c.byte_len as usize != half || readback.read_to_vec(..) != pattern {
        return Err("the bytes read back differ from the bytes written".into());
    }
    println!("read: ok, {half} B read back byte-exact");

    let word = domain.register(8, Access::LOCAL)?;
    let counter_at = RemoteAddr {
        addr: counter,
        rkey: remote.rkey,
    };
    ep.fetch_add(4, &word, 0, counter_at, 0)?;
    expect(&mut cq, "fetch-and-add", 4, Opcode::FetchAdd)?;
    let first = word.read_u64(0);
    for i in 0..100u64 {
        ep.fetch_add(10 + i, &word, 0, counter_at, 3)?;
        expect(&mut cq, "fetch-and-add", 10 + i, Opcode::FetchAdd)?;
        let old = word.read_u64(0);
        if old != first.wrapping_add(3 * i) {
            return Err(format!(
                "fetch-and-add {i} returned {old}, expected {}",
                first.wrapping_add(3 * i)
            )
            .into());
        }
    }
    let now = first.wrapping_add(300);
    ep.compare_swap(200, &word, 0, counter_at, now, now ^ 0xFF)?;
    expect(&mut cq, "compare-and-swap", 200, Opcode::CompareSwap)?;
    if word.read_u64(0) != now {
        return Err(format!(
            "compare-and-swap returned {}, expected {now}",
            word.read_u64(0)
        )
        .into());
    }
    ep.fetch_add(201, &word, 0, counter_at, 0)?;
    expect(&mut cq, "fetch-and-add", 201, Opcode::FetchAdd)?;
    if word.read_u64(0) != now ^ 0xFF {
        return Err("compare-and-swap did not swap".into());
    }
    println!("fetch-and-add: ok, 100 adds from {first} in order; compare-and-swap: ok");

    let Some(within) = await_peer_loss else {
        return Ok(());
    };
    await_loss(&ep, &mut cq, &word, counter_at, within)
}

/// Waits until the peer is lost, keeping one fetch-and-add outstanding so a
/// peer that vanishes without a word is noticed by the transport too.
fn await_loss(
    ep: &rfaas_fabric::Endpoint,
    cq: &mut rfaas_fabric::CompletionQueue,
    word: &rfaas_fabric::MemoryRegion,
    counter: RemoteAddr,
    within: Duration,
) -> Res<()> {
    ep.post_recv(300)?;
    println!("awaiting peer loss");
    std::io::stdout().flush()?;
    let start = Instant::now();
    let mut next_probe = 1000u64;
    let mut outstanding = false;
    let mut done = [Completion::EMPTY; 4];
    while start.elapsed() < within {
        if !outstanding {
            ep.fetch_add(next_probe, word, 0, counter, 0)?;
            next_probe += 1;
            outstanding = true;
        }
        let n = cq.wait(&mut done, Duration::from_millis(100))?;
        for c in &done[..n] {
            match c.status {
                rfaas_fabric::Status::PeerLost => {
                    println!(
                        "peer loss: ok, {:?} of request {} completed with PeerLost {:.0} ms after waiting began",
                        c.opcode,
                        c.wr_id,
                        start.elapsed().as_secs_f64() * 1e3
                    );
                    return Ok(());
                }
                rfaas_fabric::Status::Success if c.opcode == Opcode::FetchAdd => {
                    outstanding = false;
                    std::thread::sleep(Duration::from_millis(100));
                }
                _ => return Err(format!("while awaiting peer loss: {c:?}").into()),
            }
        }
    }
    Err(format!("the peer was not reported lost within {within:?}").into())
}
