//! Accounting tickets in a real manager's registration and heartbeat
//! replies: signed with its lease key for the node and credential that
//! asked, for `accounting_ticket_s`, and absent when the admin token
//! speaks for a node.

use rfaas_proto::lease::LeaseKeys;
use rfaas_proto::ticket::{AccountingTicket, TicketClaims};
use rfaas_testkit::accounting::credential_id;
use rfaas_testkit::manager::{Api, Manager, ManagerOptions, MANAGER_KEY_ID};
use serde_json::{json, Value};

fn register_body() -> Value {
    json!({
        "control_addr": "127.0.0.1:7100",
        "providers": [{"name": "tcp", "host": "127.0.0.1"}],
        "cores": 2,
        "memory_mib": 1024,
    })
}

/// The claims of the ticket in `reply`, checked with `m`'s public key.
fn claims(m: &Manager, reply: &Value) -> TicketClaims {
    let text = reply["accounting_ticket"]
        .as_str()
        .unwrap_or_else(|| panic!("no accounting ticket: {reply}"));
    let mut keys = LeaseKeys::new();
    keys.add_text(&m.public_key_line()).unwrap();
    AccountingTicket::from_text(text)
        .unwrap()
        .verify(&keys, rfaas_service::now_s())
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn registration_and_heartbeat_replies_carry_a_fresh_signed_ticket() {
    let m = Manager::start(ManagerOptions {
        extra_config: "accounting_ticket_s = 120\n".into(),
        ..ManagerOptions::default()
    });
    let cred = m.credential("node", "n1", None);
    let node = Api::new(m.url(), &cred);
    let (status, reply) = node.call("PUT", "/v1/nodes/n1", Some(&register_body()));
    assert_eq!(status, 200, "{reply}");
    let c = claims(&m, &reply);
    assert_eq!(
        (c.node.as_str(), c.credential_id.as_str(), c.key_id.as_str()),
        ("n1", credential_id(&cred), MANAGER_KEY_ID)
    );
    assert_eq!(c.expires_at - c.issued_at, 120);
    let text = reply["accounting_ticket"].as_str().unwrap();
    assert!(!text.contains(cred.rsplit('.').next().unwrap()));

    let beat = json!({"free_cores": 2, "free_memory_mib": 1024, "allocations": []});
    let (status, reply) = node.call("POST", "/v1/nodes/n1/heartbeat", Some(&beat));
    assert_eq!(status, 200, "{reply}");
    let again = claims(&m, &reply);
    assert_eq!((again.node, again.credential_id), (c.node, c.credential_id));

    // The admin token names no node credential: no ticket.
    let (status, reply) = m
        .admin()
        .call("PUT", "/v1/nodes/n2", Some(&register_body()));
    assert_eq!(status, 200, "{reply}");
    assert!(reply.get("accounting_ticket").is_none(), "{reply}");
}

#[test]
fn the_ticket_lifetime_is_bounded_by_the_heartbeat() {
    let err = Manager::try_start(
        &rfaas_testkit::manager::manager_binary(),
        ManagerOptions {
            extra_config: "accounting_ticket_s = 1\n".into(),
            ..ManagerOptions::default()
        },
    )
    .unwrap_err();
    assert!(err.contains("accounting_ticket_s"), "{err}");
}
