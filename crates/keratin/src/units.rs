//! Sizes, durations and points in time as the CLI's flags spell them (`512MiB`, `7d`,
//! `2026-12-04T14:00:00Z`), and times as it prints them.
//!
//! Owns only the spelling: what a bound or a start means belongs to the verb and the broker.

/// Binary size units, lower case, with their factor. A bare number is bytes.
const SIZE_UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("k", 1 << 10),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("tib", 1 << 40),
];

/// Duration units with their length in milliseconds.
const DURATION_UNITS_MS: &[(&str, u64)] = &[
    ("ms", 1),
    ("s", 1000),
    ("m", 60 * 1000),
    ("h", 60 * 60 * 1000),
    ("d", 24 * 60 * 60 * 1000),
];

/// Milliseconds in a day, for the calendar arithmetic below.
const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// Splits `text` into its leading digits and the rest (the unit), lower-cased and trimmed.
fn number_and_unit(text: &str) -> Option<(u64, String)> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let number = text[..digits].parse().ok()?;
    Some((number, text[digits..].trim().to_ascii_lowercase()))
}

/// `1073741824`, `512MiB`, `1g`: bytes, or a whole number of KiB, MiB, GiB or TiB (powers of
/// 1024; `K`, `M`, `G`, `T` mean the same).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let invalid = || {
        format!("{text:?} is not a size: expected bytes, or a whole number with KiB, MiB, GiB or TiB (for example 512MiB)")
    };
    let (number, unit) = number_and_unit(text).ok_or_else(invalid)?;
    let factor = if unit.is_empty() {
        1
    } else {
        SIZE_UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .map(|&(_, factor)| factor)
            .ok_or_else(invalid)?
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is larger than 2^64 bytes"))
}

/// `500ms`, `30s`, `15m`, `12h`, `7d`, in milliseconds. A unit is required: a bare number
/// could mean seconds or milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let invalid = || {
        format!("{text:?} is not a duration: expected a whole number with ms, s, m, h or d (for example 7d)")
    };
    let (number, unit) = number_and_unit(text).ok_or_else(invalid)?;
    let factor = DURATION_UNITS_MS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|&(_, factor)| factor)
        .ok_or_else(invalid)?;
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is longer than 2^64 ms"))
}

/// An RFC 3339 time (`2026-12-04T14:00:00Z`, `2026-12-04T15:00:00.250+01:00`; a space may
/// stand for the `T`), in ms since the Unix epoch. Times before 1970 are refused.
pub fn parse_rfc3339_ms(text: &str) -> Result<u64, String> {
    let invalid = |why: &str| {
        format!(
            "{text:?} is not an RFC 3339 time ({why}); expected for example 2026-12-04T14:00:00Z"
        )
    };
    let bytes = text.as_bytes();
    if bytes.len() < 20 {
        return Err(invalid("too short"));
    }
    let field = |range: std::ops::Range<usize>| -> Result<i64, String> {
        let part = text.get(range).ok_or_else(|| invalid("not ASCII"))?;
        if !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid("a field is not a number"));
        }
        part.parse().map_err(|_| invalid("a field is not a number"))
    };
    let separators_ok = bytes[4] == b'-'
        && bytes[7] == b'-'
        && matches!(bytes[10], b'T' | b't' | b' ')
        && bytes[13] == b':'
        && bytes[16] == b':';
    if !separators_ok {
        return Err(invalid("separators"));
    }
    let (year, month, day) = (field(0..4)?, field(5..7)?, field(8..10)?);
    let (hour, minute, second) = (field(11..13)?, field(14..16)?, field(17..19)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err(invalid("a field is out of range"));
    }
    let mut rest = &text[19..];
    let mut millis = 0;
    if let Some(fraction) = rest.strip_prefix('.') {
        let digits = fraction
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(fraction.len());
        if digits == 0 {
            return Err(invalid("an empty fraction"));
        }
        // Milliseconds: the first three digits, padded; finer digits are dropped.
        let padded = format!("{:0<3}", &fraction[..digits.min(3)]);
        millis = padded.parse().map_err(|_| invalid("the fraction"))?;
        rest = &fraction[digits..];
    }
    let offset_minutes = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6
            && matches!(rest.as_bytes()[0], b'+' | b'-')
            && rest.as_bytes()[3] == b':' =>
        {
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            let hours: i64 = rest[1..3].parse().map_err(|_| invalid("the offset"))?;
            let minutes: i64 = rest[4..6].parse().map_err(|_| invalid("the offset"))?;
            sign * (hours * 60 + minutes)
        }
        _ => return Err(invalid("no Z or +HH:MM offset")),
    };
    let days = days_from_civil(year, month, day);
    let ms = days * DAY_MS + ((hour * 60 + minute - offset_minutes) * 60 + second) * 1000 + millis;
    u64::try_from(ms).map_err(|_| invalid("before 1970"))
}

/// `ms` since the Unix epoch as RFC 3339 in UTC with milliseconds:
/// `2026-12-04T14:00:00.123Z`.
pub fn format_time_ms(ms: u64) -> String {
    let ms = i64::try_from(ms).unwrap_or(i64::MAX);
    let days = ms.div_euclid(DAY_MS);
    let in_day = ms.rem_euclid(DAY_MS);
    let (year, month, day) = civil_from_days(days);
    let seconds = in_day / 1000;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60,
        in_day % 1000
    )
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_index = (month + 9) % 12;
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The date of a day since 1970-01-01 (Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_bytes_or_binary_units() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("2 TiB"), Ok(2 << 40));
        assert_eq!(parse_size("7B"), Ok(7));
        for bad in ["", "MiB", "1.5GiB", "-1", "12 parsecs", "1KB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(parse_size("99999999999TiB").unwrap_err().contains("2^64"));
    }

    #[test]
    fn durations_need_a_unit() {
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("30s"), Ok(30_000));
        assert_eq!(parse_duration_ms("15m"), Ok(900_000));
        assert_eq!(parse_duration_ms("12h"), Ok(43_200_000));
        assert_eq!(parse_duration_ms("7d"), Ok(604_800_000));
        let error = parse_duration_ms("30").unwrap_err();
        assert!(error.contains("ms, s, m, h or d"), "{error}");
        assert!(parse_duration_ms("1w").is_err());
    }

    #[test]
    fn rfc3339_times_parse_and_print_back() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(
            parse_rfc3339_ms("2023-11-14T22:13:20Z"),
            Ok(1_700_000_000_000)
        );
        assert_eq!(
            parse_rfc3339_ms("2023-11-14T23:13:20.5+01:00"),
            Ok(1_700_000_000_500)
        );
        assert_eq!(
            parse_rfc3339_ms("2024-02-29 12:00:00.123456z"),
            Ok(1_709_208_000_123)
        );
        for bad in [
            "2023-02-29T00:00:00Z",
            "2023-11-14T22:13:20",
            "2023-11-14",
            "1969-12-31T23:59:59Z",
            "2023-13-01T00:00:00Z",
            "2023-11-14T22:13:20.Z",
        ] {
            assert!(parse_rfc3339_ms(bad).is_err(), "{bad}");
        }
        assert_eq!(
            format_time_ms(1_700_000_000_500),
            "2023-11-14T22:13:20.500Z"
        );
        assert_eq!(format_time_ms(0), "1970-01-01T00:00:00.000Z");
        for ms in [0, 951_782_400_000, 1_709_208_000_123, 4_102_444_800_000] {
            assert_eq!(parse_rfc3339_ms(&format_time_ms(ms)), Ok(ms));
        }
    }
}
