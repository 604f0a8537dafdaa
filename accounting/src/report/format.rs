//! The fields of `--format` and the four outputs: an aligned table for
//! people, `--parsable2` (`|` between fields, as `sacct -P`), CSV (RFC
//! 4180) and JSON.
//!
//! Figures print with fixed decimals in the text outputs (GiB-seconds and
//! seconds to the millisecond, costs to four places) and unrounded in
//! JSON.

use std::fmt::Write as _;

use rfaas_service::table::Table;
use serde_json::{json, Map, Value};

use super::{BillingError, Key, Row};
use crate::rates::{alloc_gib_s, seconds};

/// How to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// An aligned table with a title line, for people.
    Table,
    /// `|` between fields, none at the end of a line.
    Parsable2,
    /// Comma-separated values, quoted where needed.
    Csv,
    /// One JSON document.
    Json,
}

/// A field of a report (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// The user.
    User,
    /// The account.
    Account,
    /// The batch job.
    JobId,
    /// The node.
    Node,
    /// The lease.
    Lease,
    /// Whether the lease was on harvested capacity.
    Harvested,
    /// How many leases the row sums.
    Leases,
    /// Allocation, GiB-seconds.
    AllocGiBSec,
    /// Compute, seconds.
    ComputeSec,
    /// Hot polling, seconds.
    HotPollSec,
    /// Warm (blocked) time, seconds.
    WarmSec,
    /// Invocations.
    Invocations,
    /// Request bytes received.
    BytesIn,
    /// Response bytes sent.
    BytesOut,
    /// The cost.
    Cost,
}

/// Every field: its `--format` name (also the header), its JSON name, and
/// the grouping that fixes it (`None`: a figure, any grouping).
const FIELDS: [(Field, &str, &str, Option<Key>); 15] = [
    (Field::User, "User", "user", Some(Key::User)),
    (Field::Account, "Account", "account", Some(Key::Account)),
    (Field::JobId, "JobID", "job_id", Some(Key::Job)),
    (Field::Node, "Node", "node", Some(Key::Node)),
    (Field::Lease, "Lease", "lease", Some(Key::Lease)),
    (Field::Harvested, "Harvested", "harvested", Some(Key::Lease)),
    (Field::Leases, "Leases", "leases", None),
    (Field::AllocGiBSec, "AllocGiBSec", "alloc_gib_s", None),
    (Field::ComputeSec, "ComputeSec", "compute_s", None),
    (Field::HotPollSec, "HotPollSec", "hot_poll_s", None),
    (Field::WarmSec, "WarmSec", "warm_s", None),
    (Field::Invocations, "Invocations", "invocations", None),
    (Field::BytesIn, "BytesIn", "bytes_in", None),
    (Field::BytesOut, "BytesOut", "bytes_out", None),
    (Field::Cost, "Cost", "cost", None),
];

/// The figures a report shows unless `--format` says otherwise.
const DEFAULT_FIGURES: [Field; 7] = [
    Field::AllocGiBSec,
    Field::ComputeSec,
    Field::HotPollSec,
    Field::Invocations,
    Field::BytesIn,
    Field::BytesOut,
    Field::Cost,
];

impl Field {
    fn entry(self) -> &'static (Field, &'static str, &'static str, Option<Key>) {
        FIELDS.iter().find(|f| f.0 == self).unwrap_or(&FIELDS[0])
    }

    /// Its name in `--format` and headers.
    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// Its name in JSON.
    pub fn json_name(self) -> &'static str {
        self.entry().2
    }

    /// The field showing key `k`.
    fn of_key(k: Key) -> Field {
        match k {
            Key::User => Field::User,
            Key::Account => Field::Account,
            Key::Job => Field::JobId,
            Key::Node => Field::Node,
            Key::Lease => Field::Lease,
        }
    }

    /// Whether rows grouped by `by` have one value of this field.
    fn fixed_by(self, by: &[Key]) -> bool {
        match self.entry().3 {
            None => true,
            Some(k) => by.contains(&k) || by.contains(&Key::Lease),
        }
    }

    fn cell(self, row: &Row) -> Cell {
        let u = &row.usage;
        match self {
            Field::User => Cell::Text(row.user.clone()),
            Field::Account => Cell::Text(row.account.clone()),
            Field::JobId => Cell::Int(row.job),
            Field::Node => Cell::Text(row.node.clone()),
            Field::Lease => Cell::Int(row.lease),
            Field::Harvested => Cell::Bool(row.harvested),
            Field::Leases => Cell::Int(Some(row.leases)),
            Field::AllocGiBSec => Cell::Real(Some(alloc_gib_s(u.alloc_mib_ms)), 3),
            Field::ComputeSec => Cell::Real(Some(seconds(u.compute_ns)), 3),
            Field::HotPollSec => Cell::Real(Some(seconds(u.hot_ns)), 3),
            Field::WarmSec => Cell::Real(Some(seconds(u.warm_ns)), 3),
            Field::Invocations => Cell::Int(Some(u.invocations)),
            Field::BytesIn => Cell::Int(Some(u.bytes_in)),
            Field::BytesOut => Cell::Int(Some(u.bytes_out)),
            Field::Cost => Cell::Real(Some(row.cost), MONEY_DECIMALS),
        }
    }
}

/// Decimals of amounts of money in the text outputs.
pub const MONEY_DECIMALS: usize = 4;

/// The fields a report grouped by `by` shows by default: its keys (all of
/// a lease's for a row per lease), then the figures.
pub fn default_fields(by: &[Key]) -> Vec<Field> {
    let mut fields: Vec<Field> = if by.contains(&Key::Lease) {
        vec![
            Field::Lease,
            Field::User,
            Field::Account,
            Field::JobId,
            Field::Node,
        ]
    } else {
        by.iter().map(|&k| Field::of_key(k)).collect()
    };
    fields.extend(DEFAULT_FIGURES);
    fields
}

/// The fields of a `--format` comma list (names in any case), each of
/// which the grouping `by` must fix.
pub fn parse_fields(list: &str, by: &[Key]) -> Result<Vec<Field>, BillingError> {
    let mut fields = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let Some(f) = FIELDS.iter().find(|f| f.1.eq_ignore_ascii_case(name)) else {
            let names: Vec<&str> = FIELDS.iter().map(|f| f.1).collect();
            return Err(BillingError::Usage(format!(
                "--format: there is no field {name:?}; the fields are {}",
                names.join(",")
            )));
        };
        if !f.0.fixed_by(by) {
            let key = f.3.map_or("?", Key::name);
            return Err(BillingError::Usage(format!(
                "--format: rows by {} have no single {}; add {key} to --by, or give --by lease",
                by.iter().map(|k| k.name()).collect::<Vec<_>>().join(","),
                f.1
            )));
        }
        fields.push(f.0);
    }
    if fields.is_empty() {
        return Err(BillingError::Usage(
            "--format is empty; give a comma list of fields".into(),
        ));
    }
    Ok(fields)
}

/// One value to print.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// A name; `None` prints empty (`-` in a table), `null` in JSON.
    Text(Option<String>),
    /// A count or id.
    Int(Option<u64>),
    /// A figure and its decimals in text.
    Real(Option<f64>, usize),
    /// Yes or no.
    Bool(Option<bool>),
}

impl Cell {
    fn text(&self) -> String {
        match self {
            Cell::Text(Some(s)) => s.clone(),
            Cell::Int(Some(v)) => v.to_string(),
            Cell::Real(Some(v), d) => format!("{v:.d$}"),
            Cell::Bool(Some(b)) => (if *b { "yes" } else { "no" }).into(),
            _ => String::new(),
        }
    }

    fn json(&self) -> Value {
        match self {
            Cell::Text(Some(s)) => json!(s),
            Cell::Int(Some(v)) => json!(v),
            Cell::Real(Some(v), _) => json!(v),
            Cell::Bool(Some(b)) => json!(b),
            _ => Value::Null,
        }
    }

    fn right(&self) -> bool {
        matches!(self, Cell::Int(_) | Cell::Real(..))
    }
}

/// Rows of cells under named columns, ready to print in any [`Output`].
#[derive(Debug, Clone, Default)]
pub struct Sheet {
    /// The table's title line.
    pub title: String,
    /// Column names, and their JSON names.
    pub columns: Vec<(&'static str, &'static str)>,
    /// Whether each column aligns right in a table (numbers).
    pub right: Vec<bool>,
    /// The rows.
    pub rows: Vec<Vec<Cell>>,
    /// What the JSON document says besides its `rows`.
    pub meta: Map<String, Value>,
}

impl Sheet {
    /// A report's sheet: `fields` of `rows`.
    pub fn report(
        title: String,
        fields: &[Field],
        rows: &[Row],
        meta: Map<String, Value>,
    ) -> Sheet {
        let blank = Row::default();
        Sheet {
            title,
            columns: fields.iter().map(|f| (f.name(), f.json_name())).collect(),
            right: fields.iter().map(|f| f.cell(&blank).right()).collect(),
            rows: rows
                .iter()
                .map(|r| fields.iter().map(|f| f.cell(r)).collect())
                .collect(),
            meta,
        }
    }

    /// The sheet's text in `output`; `header` false leaves out the title
    /// and the header line (not in JSON).
    pub fn render(&self, output: Output, header: bool) -> String {
        match output {
            Output::Table => {
                let cols: Vec<(&'static str, bool)> = self
                    .columns
                    .iter()
                    .zip(&self.right)
                    .map(|(c, &r)| (c.0, r))
                    .collect();
                let mut t = Table::new(&cols);
                for row in &self.rows {
                    t.row(
                        row.iter()
                            .map(|c| match c.text() {
                                s if s.is_empty() => "-".into(),
                                s => s,
                            })
                            .collect(),
                    );
                }
                let text = t.render();
                if header {
                    format!("{}\n{text}", self.title)
                } else {
                    text.split_once('\n')
                        .map_or(String::new(), |(_, rows)| rows.into())
                }
            }
            Output::Parsable2 | Output::Csv => {
                let (sep, quote): (char, fn(String) -> String) = if output == Output::Csv {
                    (',', csv_quote)
                } else {
                    ('|', |s| s)
                };
                let mut out = String::new();
                let line = |out: &mut String, cells: Vec<String>| {
                    let cells: Vec<String> = cells.into_iter().map(quote).collect();
                    let _ = writeln!(out, "{}", cells.join(&sep.to_string()));
                };
                if header {
                    line(
                        &mut out,
                        self.columns.iter().map(|c| c.0.to_string()).collect(),
                    );
                }
                for row in &self.rows {
                    line(&mut out, row.iter().map(Cell::text).collect());
                }
                out
            }
            Output::Json => {
                let rows: Vec<Value> = self
                    .rows
                    .iter()
                    .map(|row| {
                        Value::Object(
                            self.columns
                                .iter()
                                .zip(row)
                                .map(|(c, cell)| (c.1.to_string(), cell.json()))
                                .collect(),
                        )
                    })
                    .collect();
                let mut doc = self.meta.clone();
                doc.insert("rows".into(), Value::Array(rows));
                let mut text = serde_json::to_string_pretty(&Value::Object(doc))
                    .unwrap_or_else(|_| "{}".into());
                text.push('\n');
                text
            }
        }
    }
}

/// A CSV field, quoted if it holds a separator, a quote or a line break.
fn csv_quote(s: String) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::accounting::UsageFigures;

    fn sheet() -> Sheet {
        let rows = [
            Row {
                account: Some("physics, \"hep\"".into()),
                leases: 2,
                usage: UsageFigures {
                    alloc_mib_ms: 1024 * 1500,
                    compute_ns: 2_500_000_000,
                    invocations: 12,
                    ..UsageFigures::default()
                },
                cost: 0.03126,
                ..Row::default()
            },
            Row {
                account: None,
                leases: 1,
                ..Row::default()
            },
        ];
        let fields = parse_fields(
            "account,AllocGiBSec,computesec,Invocations,Cost",
            &[Key::Account],
        )
        .unwrap();
        let mut meta = Map::new();
        meta.insert("currency".into(), json!("CHF"));
        Sheet::report("Usage by account".into(), &fields, &rows, meta)
    }

    #[test]
    fn each_output_prints_the_same_rows() {
        let s = sheet();
        assert_eq!(
            s.render(Output::Table, true),
            "Usage by account\n\
             Account         AllocGiBSec  ComputeSec  Invocations    Cost\n\
             physics, \"hep\"        1.500       2.500           12  0.0313\n\
             -                     0.000       0.000            0  0.0000\n"
        );
        assert_eq!(
            s.render(Output::Parsable2, true),
            "Account|AllocGiBSec|ComputeSec|Invocations|Cost\n\
             physics, \"hep\"|1.500|2.500|12|0.0313\n\
             |0.000|0.000|0|0.0000\n"
        );
        assert_eq!(
            s.render(Output::Csv, false),
            "\"physics, \"\"hep\"\"\",1.500,2.500,12,0.0313\n,0.000,0.000,0,0.0000\n"
        );
        let v: Value = serde_json::from_str(&s.render(Output::Json, true)).unwrap();
        assert_eq!(
            v,
            json!({"currency": "CHF", "rows": [
                {"account": "physics, \"hep\"", "alloc_gib_s": 1.5, "compute_s": 2.5, "invocations": 12, "cost": 0.03126},
                {"account": null, "alloc_gib_s": 0.0, "compute_s": 0.0, "invocations": 0, "cost": 0.0},
            ]})
        );
    }

    #[test]
    fn format_refuses_unknown_fields_with_the_list() {
        let e = parse_fields("Account,CPUTime", &[Key::Account])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"CPUTime\""), "{e}");
        assert!(
            e.contains("User,Account,JobID,Node,Lease,Harvested,Leases,AllocGiBSec"),
            "{e}"
        );
        let e = parse_fields("User,Cost", &[Key::Account])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no single User") && e.contains("add user to --by"),
            "{e}"
        );
        assert_eq!(
            parse_fields("user,node,harvested", &[Key::Lease]).unwrap(),
            [Field::User, Field::Node, Field::Harvested]
        );
        assert!(parse_fields(" , ", &[Key::User]).is_err());
    }

    #[test]
    fn default_fields_lead_with_the_keys() {
        let f = default_fields(&[Key::Job, Key::User]);
        assert_eq!(f[..3], [Field::JobId, Field::User, Field::AllocGiBSec]);
        assert_eq!(f.last(), Some(&Field::Cost));
        assert_eq!(
            default_fields(&[Key::Lease])[..5],
            [
                Field::Lease,
                Field::User,
                Field::Account,
                Field::JobId,
                Field::Node
            ]
        );
    }
}
