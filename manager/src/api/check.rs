//! Checks of input fields several resources share: names, free text,
//! memory sizes. Each refuses with a `400 malformed_request` naming the
//! field and the rule.

use crate::error::ApiError;

/// Longest node, user or account name.
const MAX_NAME: usize = 253;

/// Refuses a user or account name that is not 1 to [`MAX_NAME`] letters,
/// digits, `.`, `_`, `-` or `@`.
pub(super) fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-@".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::Malformed(format!(
            "the {what} {name:?} must be 1 to {MAX_NAME} letters, digits, '.', '_', '-' or '@'"
        )))
    }
}

/// Refuses a node name that does not follow the one pattern
/// ([`rfaas_proto::node_name`]), naming it.
pub(super) fn check_node_name(name: &str) -> Result<(), ApiError> {
    rfaas_proto::node_name::check(name).map_err(|e| ApiError::Malformed(e.to_string()))
}

/// Refuses control characters (NUL above all: PostgreSQL cannot store it
/// in text) in a free-text field.
pub(super) fn check_text(what: &str, text: &str) -> Result<(), ApiError> {
    if text.chars().any(char::is_control) {
        return Err(ApiError::Malformed(format!(
            "{what} {text:?} holds control characters; send printable text"
        )));
    }
    Ok(())
}

/// Refuses a memory size of 0 or above `u32::MAX` MiB.
pub(super) fn check_memory(memory_mib: u64) -> Result<(), ApiError> {
    if memory_mib == 0 || memory_mib > u64::from(u32::MAX) {
        return Err(ApiError::Malformed(format!(
            "memory_mib is {memory_mib}; it must be 1 to {}",
            u32::MAX
        )));
    }
    Ok(())
}
