//! Text helpers every layer shares, defined once: a time as people read it, an id as people
//! type it, a body as one short line.

/// `ms` since the epoch as an RFC 3339 time to the second (`2026-12-02T13:38:32Z`).
pub fn when(ms: i64) -> String {
    let t =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The first 8 characters of an id: what lists show and what people type.
pub fn short(id: &str) -> &str {
    match id.char_indices().nth(8) {
        Some((i, _)) => &id[..i],
        None => id,
    }
}

/// `s` on one line (runs of whitespace become one space), cut to `chars` characters with an
/// ellipsis.
pub fn one_line(s: &str, chars: usize) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(chars) {
        Some((i, _)) => format!("{}…", &flat[..i]),
        None => flat,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_flattens_and_cuts_on_characters() {
        assert_eq!(one_line("a\n  b\tc", 10), "a b c");
        assert_eq!(one_line("ééééé", 3), "ééé…");
        assert_eq!(one_line("abc", 3), "abc");
        assert_eq!(short("0123456789"), "01234567");
        assert_eq!(short("é"), "é");
        assert_eq!(when(0), "1970-01-01T00:00:00Z");
    }
}
