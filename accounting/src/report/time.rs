//! Times on `rfaas-billing`'s command line and in its reports. As in
//! `sacct`, a date without a zone is local time (the `TZ` environment
//! variable, else the system's zone), and `now` may be moved by a count
//! of seconds, minutes, hours, days or weeks.

/// The forms [`parse`] accepts, for error messages and `--help`.
pub const FORMS: &str = "YYYY-MM-DD, YYYY-MM-DDTHH:MM or YYYY-MM-DDTHH:MM:SS (local time), \
today or midnight (00:00 today), now, or now-N / now+N with N seconds or N followed by \
seconds, minutes, hours, days or weeks (now-7days, now-90minutes)";

/// A time that [`parse`] does not understand.
#[derive(Debug, thiserror::Error)]
#[error("{input:?} is not a time{why}; give {FORMS}")]
pub struct BadTime {
    /// What was given.
    pub input: String,
    /// A more precise reason, such as " (month 13)", or empty.
    pub why: String,
}

fn bad(input: &str, why: &str) -> BadTime {
    BadTime {
        input: input.to_owned(),
        why: if why.is_empty() {
            String::new()
        } else {
            format!(" ({why})")
        },
    }
}

/// The multiplier of a unit after `now-N`, in seconds; `""` is seconds.
fn unit_seconds(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "s" | "sec" | "secs" | "second" | "seconds" => 1,
        "m" | "min" | "mins" | "minute" | "minutes" => 60,
        "h" | "hour" | "hours" => 3600,
        "d" | "day" | "days" => 86_400,
        "w" | "week" | "weeks" => 604_800,
        _ => return None,
    })
}

/// Parses a time into Unix milliseconds; `now_ms` is what `now` means.
pub fn parse(input: &str, now_ms: u64) -> Result<u64, BadTime> {
    let s = input.trim();
    let lower = s.to_ascii_lowercase();
    if lower == "today" || lower == "midnight" {
        return start_of_day(now_ms).ok_or_else(|| bad(input, "no local midnight"));
    }
    if let Some(rest) = lower.strip_prefix("now") {
        if rest.is_empty() {
            return Ok(now_ms);
        }
        let (sign, rest) = match rest.split_at(1) {
            ("-", r) => (-1i128, r),
            ("+", r) => (1i128, r),
            _ => return Err(bad(input, "now is followed by - or +")),
        };
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let (count, unit) = rest.split_at(digits);
        let count: u64 = count
            .parse()
            .map_err(|_| bad(input, "a count follows now- or now+"))?;
        let unit = unit_seconds(unit).ok_or_else(|| {
            bad(
                input,
                &format!("{unit:?} is not one of seconds, minutes, hours, days, weeks"),
            )
        })?;
        let at = i128::from(now_ms) + sign * i128::from(count) * i128::from(unit) * 1000;
        return u64::try_from(at).map_err(|_| bad(input, "before 1970"));
    }
    let (date, clock) = match s.split_once(['T', 't']) {
        Some((d, c)) => (d, Some(c)),
        None => (s, None),
    };
    let num = |part: &str, what: &str, digits: usize| -> Result<i32, BadTime> {
        if part.len() != digits || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(input, &format!("the {what} is {digits} digits")));
        }
        part.parse().map_err(|_| bad(input, ""))
    };
    let d: Vec<&str> = date.split('-').collect();
    if d.len() != 3 {
        return Err(bad(input, ""));
    }
    let (year, month, day) = (
        num(d[0], "year", 4)?,
        num(d[1], "month", 2)?,
        num(d[2], "day", 2)?,
    );
    if !(1..=12).contains(&month) {
        return Err(bad(input, &format!("month {month}")));
    }
    if day < 1 || day > days_in_month(year, month) {
        return Err(bad(input, &format!("{year}-{month:02} has no day {day}")));
    }
    let (mut hour, mut minute, mut second) = (0, 0, 0);
    if let Some(clock) = clock {
        let c: Vec<&str> = clock.split(':').collect();
        if !(2..=3).contains(&c.len()) {
            return Err(bad(input, "the time of day is HH:MM or HH:MM:SS"));
        }
        hour = num(c[0], "hour", 2)?;
        minute = num(c[1], "minute", 2)?;
        if let Some(sec) = c.get(2) {
            second = num(sec, "second", 2)?;
        }
        if hour > 23 || minute > 59 || second > 59 {
            return Err(bad(input, &format!("{hour:02}:{minute:02}:{second:02}")));
        }
    }
    let secs = from_local(year, month, day, hour, minute, second)
        .ok_or_else(|| bad(input, "not a local time"))?;
    u64::try_from(secs)
        .map(|s| s * 1000)
        .map_err(|_| bad(input, "before 1970"))
}

fn days_in_month(year: i32, month: i32) -> i32 {
    match month {
        4 | 6 | 9 | 11 => 30,
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        _ => 31,
    }
}

/// The broken-down local time of Unix second `secs`.
fn local_tm(secs: i64) -> Option<libc::tm> {
    let t = secs as libc::time_t;
    // SAFETY: `tm` is plain data, for which all zeros is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to locals that outlive the call;
    // localtime_r keeps neither.
    let ok = unsafe { libc::localtime_r(&t, &mut tm) };
    (!ok.is_null()).then_some(tm)
}

/// The Unix second of a local date and time (daylight saving time as the
/// zone has it on that day); `None` when the C library cannot place it.
pub fn from_local(
    year: i32,
    month: i32,
    day: i32,
    hour: i32,
    minute: i32,
    second: i32,
) -> Option<i64> {
    // SAFETY: `tm` is plain data, for which all zeros is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    tm.tm_year = year - 1900;
    tm.tm_mon = month - 1;
    tm.tm_mday = day;
    tm.tm_hour = hour;
    tm.tm_min = minute;
    tm.tm_sec = second;
    tm.tm_isdst = -1;
    // SAFETY: the pointer is to a local that outlives the call; mktime
    // keeps nothing.
    let t = unsafe { libc::mktime(&mut tm) };
    (t != -1).then_some(t as i64)
}

/// 00:00 local time of the day `now_ms` falls in, Unix ms.
pub fn start_of_day(now_ms: u64) -> Option<u64> {
    let tm = local_tm((now_ms / 1000) as i64)?;
    let secs = from_local(tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, 0, 0, 0)?;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// `YYYY-MM-DDTHH:MM:SS` in local time, as sacct prints times.
pub fn local(ms: u64) -> String {
    match local_tm((ms / 1000) as i64) {
        Some(tm) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            tm.tm_year + 1900,
            tm.tm_mon + 1,
            tm.tm_mday,
            tm.tm_hour,
            tm.tm_min,
            tm.tm_sec
        ),
        None => format!("@{}", ms / 1000),
    }
}

/// RFC 3339 in local time with its offset (`2024-05-01T00:00:00+02:00`),
/// for JSON.
pub fn rfc3339(ms: u64) -> String {
    let off = local_tm((ms / 1000) as i64).map_or(0, |tm| tm.tm_gmtoff);
    let sign = if off < 0 { '-' } else { '+' };
    let off = off.unsigned_abs();
    format!(
        "{}{sign}{:02}:{:02}",
        local(ms),
        off / 3600,
        off % 3600 / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2024-03-05T06:07:08Z; the tests run in the process's zone, so they
    // check against local() rather than fixed UTC figures.
    const NOW: u64 = 1_709_618_828_000;

    #[test]
    fn now_moves_by_units_like_sacct() {
        assert_eq!(parse("now", NOW).unwrap(), NOW);
        assert_eq!(parse("now-30", NOW).unwrap(), NOW - 30_000);
        assert_eq!(parse("now+2minutes", NOW).unwrap(), NOW + 120_000);
        assert_eq!(parse("NOW-1hour", NOW).unwrap(), NOW - 3_600_000);
        assert_eq!(parse("now-7days", NOW).unwrap(), NOW - 7 * 86_400_000);
        assert_eq!(parse("now-2w", NOW).unwrap(), NOW - 14 * 86_400_000);
        for wrong in [
            "now-",
            "now-3fortnights",
            "now*3",
            "now-x",
            "now-99999999999weeks",
        ] {
            let e = parse(wrong, NOW).unwrap_err().to_string();
            assert!(e.contains(wrong) && e.contains("YYYY-MM-DD"), "{e}");
        }
    }

    #[test]
    fn dates_are_local_and_checked() {
        let day = parse("2024-03-05", NOW).unwrap();
        assert_eq!(local(day), "2024-03-05T00:00:00");
        let t = parse("2024-03-05T06:07", NOW).unwrap();
        assert_eq!(t - day, (6 * 3600 + 7 * 60) * 1000);
        assert_eq!(
            local(parse("2024-02-29T23:59:59", NOW).unwrap()),
            "2024-02-29T23:59:59"
        );
        for (wrong, says) in [
            ("2023-02-29", "2023-02 has no day 29"),
            ("2024-13-01", "month 13"),
            ("2024-1-01", "the month is 2 digits"),
            ("2024-01-01T24:00", "24:00:00"),
            ("2024-01-01T10", "HH:MM"),
            ("yesterday", "is not a time"),
            ("", "is not a time"),
        ] {
            let e = parse(wrong, NOW).unwrap_err().to_string();
            assert!(e.contains(says), "{wrong}: {e}");
        }
    }

    #[test]
    fn today_is_local_midnight() {
        let t = parse("today", NOW).unwrap();
        assert_eq!(parse("midnight", NOW).unwrap(), t);
        assert!(t <= NOW && NOW - t < 86_400_000);
        assert!(local(t).ends_with("T00:00:00"), "{}", local(t));
    }

    #[test]
    fn rfc3339_carries_the_offset() {
        let s = rfc3339(NOW);
        assert_eq!(s.len(), "2024-03-05T06:07:08+00:00".len(), "{s}");
        assert!(s.starts_with(&local(NOW)), "{s}");
    }
}
