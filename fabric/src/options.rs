//! [`EndpointOptions`]: what a connected endpoint is set up with.

use std::time::Duration;

/// Options of a connected endpoint; both sides' values are exchanged at connect.
#[derive(Clone, Debug)]
pub struct EndpointOptions {
    /// Operations that may be outstanding (posted, not completed) at once.
    pub send_depth: usize,
    /// Receives that may be posted at once.
    pub recv_depth: usize,
    /// How long connecting may take, on either side: `connect` fails with
    /// [`Error::Timeout`](crate::Error::Timeout) past it, and `accept`
    /// gives up a peer whose opening message has not arrived by then
    /// ([`Error::Connect`](crate::Error::Connect)). On tcp and shm `accept`
    /// hands out peers in the order their opening message is whole, so a
    /// silent or slow peer holds up nobody behind it.
    pub connect_timeout: Duration,
    /// verbs: InfiniBand service level (QoS class) of the queue pair.
    pub service_level: u8,
    /// verbs: index of the partition key (P_Key) in the port's table.
    pub pkey_index: u16,
    /// shm: also map the peer's regions that are files
    /// ([`Buffer::map_file`](crate::Buffer::map_file)) rather than sealed
    /// memfds. The peer could shrink such a file and make this process
    /// fault (SIGBUS) on its next access, so set it only for a peer trusted
    /// not to (rfaas: an accounting service, named in a lease token the
    /// manager signed). Without it, accesses to such a region complete with
    /// [`Status::RemoteAccess`](crate::Status::RemoteAccess). tcp and verbs
    /// ignore it.
    pub map_file_regions: bool,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            send_depth: 256,
            recv_depth: 256,
            connect_timeout: Duration::from_secs(10),
            service_level: 0,
            pkey_index: 0,
            map_file_regions: false,
        }
    }
}
