//! Tables for people, as `rfaasctl` and `rfaas-billing` print them.

use std::fmt::Write as _;

/// A table for people: columns padded to their widest cell, numbers
/// aligned right.
#[derive(Debug)]
pub struct Table {
    headers: Vec<&'static str>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these columns; `right[i]` aligns column `i` right.
    pub fn new(headers: &[(&'static str, bool)]) -> Table {
        Table {
            headers: headers.iter().map(|h| h.0).collect(),
            right: headers.iter().map(|h| h.1).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table's text, a line per row after the header.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        let mut out = String::new();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let w = widths[i];
                let _ = if self.right[i] {
                    write!(line, "{cell:>w$}")
                } else {
                    write!(line, "{cell:<w$}")
                };
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}
