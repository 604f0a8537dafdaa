//! What `--check-config` prints, alike for every daemon: each setting the
//! daemon would run with and where its value came from, then every reason
//! it would not start, then the verdict. The daemons build it without
//! binding a port or opening a connection.

use std::collections::BTreeSet;
use std::io::{self, Write};

use serde::Serialize;
use serde_json::Value;

/// The settings, their sources and the problems found.
#[derive(Debug, Default)]
pub struct Report {
    rows: Vec<(String, String, String)>,
    problems: Vec<String>,
}

impl Report {
    /// An empty report.
    pub fn new() -> Report {
        Report::default()
    }

    /// Adds a row per setting of `settings` (nested tables as dotted
    /// keys), each with the source `source_of` names for its key.
    pub fn settings(
        &mut self,
        settings: &impl Serialize,
        source_of: impl Fn(&str) -> String,
    ) -> Result<(), String> {
        let value = serde_json::to_value(settings).map_err(|e| e.to_string())?;
        let mut flat = Vec::new();
        flatten("", &value, &mut flat);
        for (key, value) in flat {
            let source = source_of(&key);
            self.rows.push((key, value, source));
        }
        Ok(())
    }

    /// Records `check`'s failure as a reason not to start.
    pub fn check(&mut self, check: Result<(), String>) {
        if let Err(why) = check {
            self.problems.push(why);
        }
    }

    /// Whether the daemon would start.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// Prints the rows (`key = value  (source)`), the problems and the
    /// verdict for `program`.
    pub fn print(&self, out: &mut impl Write, program: &str) -> io::Result<()> {
        let width = self.rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        for (key, value, source) in &self.rows {
            writeln!(out, "{key:width$} = {value}  ({source})")?;
        }
        for p in &self.problems {
            writeln!(out, "error: {p}")?;
        }
        if self.ok() {
            writeln!(
                out,
                "{program}: the configuration is usable; it would start"
            )
        } else {
            writeln!(
                out,
                "{program}: it would not start ({} problem{})",
                self.problems.len(),
                if self.problems.len() == 1 { "" } else { "s" }
            )
        }
    }
}

/// `--check-config` for `program`: `loaded` is the file as read, the
/// flags given and the settings, or why they cannot be had; `discovered`
/// names the source of a value the host supplied; `problems` checks the
/// files the daemon would read. Prints the report on stdout and returns
/// the exit status: 0 when it would start, 1 when not.
pub fn run<F: Serialize + Default, S: Serialize>(
    program: &str,
    loaded: Result<(F, Vec<&'static str>, S), String>,
    discovered: impl Fn(&S, &str) -> Option<String>,
    problems: impl FnOnce(&S) -> Vec<String>,
) -> i32 {
    let mut report = Report::new();
    match loaded {
        Ok((file, flags, settings)) => {
            let in_file = keys_set(&file);
            let rows = report.settings(&settings, |key| {
                discovered(&settings, key).unwrap_or_else(|| source(key, &flags, &in_file))
            });
            report.check(rows);
            for p in problems(&settings) {
                report.check(Err(p));
            }
        }
        Err(e) => report.check(Err(e)),
    }
    let mut out = io::stdout().lock();
    if report.print(&mut out, program).is_err() {
        return 1;
    }
    i32::from(!report.ok())
}

/// The dotted keys `config` (a configuration file as parsed) sets: those
/// whose value is not what an empty file gives (`None`, or a
/// `#[serde(default)]`).
pub fn keys_set<C: Serialize + Default>(config: &C) -> BTreeSet<String> {
    let flat = |c: &C| {
        let mut flat = Vec::new();
        if let Ok(v) = serde_json::to_value(c) {
            flatten("", &v, &mut flat);
        }
        flat
    };
    let empty: BTreeSet<(String, String)> = flat(&C::default()).into_iter().collect();
    flat(config)
        .into_iter()
        .filter(|kv| !empty.contains(kv))
        .map(|(k, _)| k)
        .collect()
}

/// Applies the flags given (`Option` fields of `$args`) over the same
/// keys of `$config` (`Option` fields too), naming each in `$flags`: the
/// one way every daemon lets its flags override its file.
#[macro_export]
macro_rules! flag_overrides {
    ($args:expr, $config:expr, $flags:expr; $($field:ident),* $(,)?) => {
        $(if let Some(v) = $args.$field.clone() {
            $config.$field = Some(v);
            $flags.push(stringify!($field));
        })*
    };
}

/// The source of `key` for a daemon whose file set `file_keys` and whose
/// flags set `flags`: `flag`, `file` or `default`.
pub fn source(key: &str, flags: &[&str], file_keys: &BTreeSet<String>) -> String {
    let within = |k: &str| key == k || key.starts_with(&format!("{k}."));
    if flags.iter().any(|f| within(f)) {
        "flag".into()
    } else if file_keys.iter().any(|k| within(k)) {
        "file".into()
    } else {
        "default".into()
    }
}

/// Serializes a duration as milliseconds (for settings kept as
/// durations whose keys are in ms).
pub fn millis<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u128(d.as_millis())
}

/// Serializes a duration as seconds.
pub fn seconds<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_secs())
}

fn flatten(prefix: &str, value: &Value, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        other => out.push((prefix.to_owned(), other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Default)]
    struct Inner {
        urls: Vec<String>,
        backoff_ms: u64,
    }

    #[derive(Serialize, Default)]
    struct Settings {
        name: String,
        manager: Inner,
        journal: Option<String>,
    }

    #[test]
    fn rows_sources_problems_and_the_verdict() {
        let s = Settings {
            name: "n1".into(),
            manager: Inner {
                urls: vec!["https://m:7300".into()],
                backoff_ms: 30_000,
            },
            journal: None,
        };
        let file: BTreeSet<String> = ["manager.urls".to_owned()].into();
        let mut r = Report::new();
        r.settings(&s, |k| source(k, &["name"], &file)).unwrap();
        r.check(Ok(()));
        let mut out = Vec::new();
        r.print(&mut out, "d").unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("name               = \"n1\"  (flag)"),
            "{text}"
        );
        assert!(
            text.contains("manager.urls       = [\"https://m:7300\"]  (file)"),
            "{text}"
        );
        assert!(
            text.contains("manager.backoff_ms = 30000  (default)"),
            "{text}"
        );
        assert!(
            text.contains("journal            = null  (default)"),
            "{text}"
        );
        assert!(text.ends_with("d: the configuration is usable; it would start\n"));
        r.check(Err("the key file is missing".into()));
        assert!(!r.ok());
        let mut out = Vec::new();
        r.print(&mut out, "d").unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("error: the key file is missing\nd: it would not start (1 problem)"));
        assert_eq!(
            keys_set(&s),
            ["manager.backoff_ms", "manager.urls", "name"]
                .map(String::from)
                .into()
        );
    }
}
