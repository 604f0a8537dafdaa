//! Reports through the manager's `GET /v1/usage`, with the caller's own
//! credential: what `rfaas-billing` does unless an admin asks for the
//! database (`--database`). The manager decides what the caller may see.

use std::time::Duration;

use rfaas_proto::manager::ApiError;

use super::{BillingError, Filters, LeaseUsage, Period};

/// Timeout of one request to one manager.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of connecting to one manager, before trying the next.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How the managers are reached: the CAs their certificates are checked
/// with (`None`: `RFAAS_CA_FILE`, else the system's roots), and whether
/// plain `http://` may leave loopback.
#[derive(Debug, Clone, Default)]
pub struct Tls {
    /// A site CA file.
    pub ca_file: Option<std::path::PathBuf>,
    /// Plain `http://` to a manager off loopback.
    pub allow_http: bool,
}

/// The usage in `period` of the leases `filters` let through that the
/// holder of `token` may see, from the first of the managers at `urls`
/// that answers. `to_now`: the period ends now, by the manager's clock,
/// with the latest totals.
pub fn lease_usage(
    urls: &[String],
    token: &str,
    tls: &Tls,
    period: Period,
    to_now: bool,
    filters: &Filters,
) -> Result<Vec<LeaseUsage>, BillingError> {
    let mut query = url::form_urlencoded::Serializer::new(String::new());
    query.append_pair("start_ms", &period.start_ms.to_string());
    if !to_now {
        query.append_pair("end_ms", &period.end_ms.to_string());
    }
    let jobs: Vec<String> = filters.jobs.iter().map(u64::to_string).collect();
    for (key, list) in [
        ("users", &filters.users),
        ("accounts", &filters.accounts),
        ("jobs", &jobs),
    ] {
        if !list.is_empty() {
            query.append_pair(key, &list.join(","));
        }
    }
    let path = format!("/v1/usage?{}", query.finish());
    let mut options =
        rfaas_tls::AgentOptions::new(REQUEST_TIMEOUT).ca_file_or_env(tls.ca_file.clone());
    options.connect_timeout = Some(CONNECT_TIMEOUT);
    let agent = rfaas_tls::agent(&options).map_err(|e| BillingError::Usage(e.to_string()))?;
    let plain = if tls.allow_http {
        rfaas_tls::PlainHttp::Allowed
    } else {
        rfaas_tls::PlainHttp::LoopbackOnly
    };
    let mut tried = Vec::new();
    for url in urls {
        let base = rfaas_tls::manager_url(url.trim(), plain)
            .map_err(|e| BillingError::Usage(e.to_string()))?;
        let base = base.as_str();
        let mut resp = match agent
            .get(&format!("{base}{path}"))
            .header("Authorization", &format!("Bearer {token}"))
            .call()
        {
            Ok(r) => r,
            Err(e) => {
                tried.push(format!("{base} ({e})"));
                continue;
            }
        };
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        if status == 200 {
            return serde_json::from_str(&text).map_err(|e| {
                BillingError::Database(format!(
                    "the manager at {base} sent usage rfaas-billing cannot read ({e}); is it an rfaas-manager of this version?"
                ))
            });
        }
        let message = serde_json::from_str::<ApiError>(&text)
            .map(|e| e.message)
            .unwrap_or_else(|_| format!("HTTP {status} from {base}"));
        return Err(match status {
            400 => BillingError::Usage(message),
            401 | 403 => BillingError::Refused(message),
            404 => BillingError::Unknown(message),
            _ => BillingError::Database(message),
        });
    }
    Err(BillingError::NoManager(tried.join(", ")))
}
