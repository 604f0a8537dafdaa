//! `grpc_echo`: a unary gRPC echo through tonic on 127.0.0.1, the kind of
//! call a conventional FaaS or RPC stack makes, as a peer for `hot_noop`.
//!
//! The service is written by hand (no `.proto`, no protoc): one method,
//! `/rfaas.bench.Echo/Echo`, whose request and response are [`Payload`], a
//! protobuf message with one `bytes` field. The server runs in its own
//! process (`--serve grpc_echo_server`) on a current-thread tokio runtime,
//! pinned like every peer; the client blocks on a current-thread runtime of
//! its own, so each sample is one whole call: encode, HTTP/2 frames over
//! TCP (`TCP_NODELAY`), decode, and back. No TLS, no compression.

use std::convert::Infallible;
use std::net::TcpListener;

use tonic::codec::ProstCodec;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};

use crate::child::{PeerSpec, Ready};
use crate::error::{Context as _, Error, Result};
use crate::report::{Report, Row};
use crate::rows::{Ctx, Kind, Provider, RowSpec, Runner, Suite};
use crate::stats::time_round_trips;

const GRPC_ECHO: &str = "grpc_echo";
const SERVER: &str = "grpc_echo_server";
const SERVICE: &str = "rfaas.bench.Echo";
const METHOD: &str = "/rfaas.bench.Echo/Echo";

pub const SUITE: Suite = Suite {
    rows: &[RowSpec {
        name: GRPC_ECHO,
        help: "a gRPC (tonic) unary echo over loopback, its server in its own process: what a job would otherwise use",
        runner: Runner::PerProvider {
            kind: Some(Kind::Tcp),
            run: grpc_echo,
        },
    }],
    peers: &[PeerSpec {
        name: SERVER,
        serve: serve_echo,
    }],
};

/// The request and the response: `message Payload { bytes data = 1; }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payload {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context(|| "could not start a tokio runtime".to_owned())
}

fn grpc_echo(ctx: &Ctx, _: &Provider, out: &mut Report) -> Result<()> {
    let peer = ctx.spawn_peer(SERVER, &[], &[])?;
    let addr = peer.addr().to_owned();
    let rt = runtime()?;
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| Error::new(format!("{addr} is not a gRPC endpoint: {e}")))?
        .tcp_nodelay(true);
    let channel: Channel = rt.block_on(endpoint.connect()).map_err(|e| {
        Error::new(format!(
            "could not connect to the gRPC server at {addr}: {e}"
        ))
    })?;
    let mut client = tonic::client::Grpc::new(channel);
    let path = PathAndQuery::from_static(METHOD);
    for &size in &ctx.sizes {
        let msg = Payload {
            data: vec![0xa5; size],
        };
        let summary = time_round_trips(ctx.warmup, ctx.iters, || {
            rt.block_on(async {
                client
                    .ready()
                    .await
                    .map_err(|e| Error::new(format!("the gRPC channel to {addr} failed: {e}")))?;
                let reply: tonic::Response<Payload> = client
                    .unary(
                        tonic::Request::new(msg.clone()),
                        path.clone(),
                        ProstCodec::default(),
                    )
                    .await
                    .map_err(|s| Error::new(format!("the gRPC echo call failed: {s}")))?;
                match reply.get_ref().data.len() {
                    n if n == size => Ok(()),
                    n => Err(Error::new(format!(
                        "the gRPC echo of {size} bytes came back with {n}"
                    ))),
                }
            })
        })?;
        out.push(&Row::latency(GRPC_ECHO, "tcp", size, summary))?;
    }
    drop(client);
    drop(rt);
    peer.finish()
}

/// `--serve grpc_echo_server`: answers [`METHOD`] on 127.0.0.1 until killed.
fn serve_echo(_: &[String], ready: Ready) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .context(|| "the gRPC server could not listen on 127.0.0.1".to_owned())?;
    let addr = listener
        .local_addr()
        .context(|| "the gRPC server could not read its own address".to_owned())?;
    listener
        .set_nonblocking(true)
        .context(|| "the gRPC server could not make its socket non-blocking".to_owned())?;
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)
            .context(|| "the gRPC server could not register its socket".to_owned())?;
        let incoming = TcpIncoming::from_listener(listener, true, None)
            .map_err(|e| Error::new(format!("the gRPC server could not accept: {e}")))?;
        ready.announce(&addr.to_string())?;
        Server::builder()
            .add_service(EchoServer)
            .serve_with_incoming(incoming)
            .await
            .map_err(|e| Error::new(format!("the gRPC server stopped: {e}")))
    })
}

/// The service, as tonic-build would generate it for one unary method.
#[derive(Debug, Clone, Copy)]
struct EchoServer;

impl NamedService for EchoServer {
    const NAME: &'static str = SERVICE;
}

impl<B> Service<http::Request<B>> for EchoServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == METHOD {
            return Box::pin(async move {
                let mut grpc = Grpc::new(ProstCodec::<Payload, Payload>::default());
                Ok(grpc.unary(Echo, req).await)
            });
        }
        Box::pin(async move {
            // gRPC status 12: unimplemented.
            let mut response = http::Response::new(tonic::codegen::empty_body());
            let headers = response.headers_mut();
            headers.insert("grpc-status", http::HeaderValue::from_static("12"));
            headers.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            Ok(response)
        })
    }
}

/// The method: the request's payload, back.
#[derive(Debug, Clone, Copy)]
struct Echo;

impl UnaryService<Payload> for Echo {
    type Response = Payload;
    type Future = BoxFuture<tonic::Response<Payload>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<Payload>) -> Self::Future {
        Box::pin(async move { Ok(tonic::Response::new(request.into_inner())) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn payload_is_field_one_bytes() {
        let p = Payload {
            data: vec![7, 8, 9],
        };
        // Tag 1, wire type 2 (length-delimited), length 3.
        assert_eq!(p.encode_to_vec(), [0x0a, 3, 7, 8, 9]);
        assert_eq!(Payload::decode(&[0x0a, 1, 5][..]).unwrap().data, [5]);
    }
}
