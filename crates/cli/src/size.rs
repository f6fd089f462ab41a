//! Parsing and printing byte sizes (`16G`, `512MiB`, `4096`).

/// Parses a size in bytes: a number with an optional binary suffix
/// (K, M, G, T, P with optional `i`/`B`: `16G` = `16GiB` = 16 × 2^30).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    let n: u64 = num.parse().map_err(|_| {
        format!("invalid size {s:?}: expected a number with an optional K/M/G/T suffix")
    })?;
    let unit = suffix.trim().to_ascii_uppercase();
    // bytes: no suffix or B; else K, KB or KiB (likewise M, G, T, P)
    let prefix = match unit.as_str() {
        "" | "B" => "",
        u => u
            .strip_suffix("IB")
            .or_else(|| u.strip_suffix('B'))
            .unwrap_or(u),
    };
    let shift = match prefix {
        "" if unit.len() <= 1 => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        "P" => 50,
        _ => return Err(format!("invalid size suffix in {s:?}: use K, M, G, T or P")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Parses a fingerprint-index budget: a size (as [`parse_size`]) of at
/// least 4 KiB (one on-disk group page; less holds no group).
pub fn parse_index_memory(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v < 4096 {
        return Err(format!("{s:?} is below the 4K minimum"));
    }
    Ok(v)
}

/// Parses a volume size: a size (as [`parse_size`]) that is a positive
/// multiple of 4 KiB (a whole number of blocks), at most 1 PiB
/// ([`dedupd_engine::engine::MAX_VOLUME_BYTES`]).
pub fn parse_volume_size(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v == 0 || !v.is_multiple_of(4096) {
        return Err(format!(
            "{s:?} is not a positive multiple of 4K (a volume holds whole 4 KiB blocks)"
        ));
    }
    if v > dedupd_engine::engine::MAX_VOLUME_BYTES {
        return Err(format!("{s:?} is over the 1 PiB limit of a volume"));
    }
    Ok(v)
}

/// Formats bytes with a binary unit (`1.5 GiB`).
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("16G").unwrap(), 16 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1k").unwrap(), 1024);
        assert!(parse_size("x").is_err());
        assert!(parse_size("5Q").is_err());
        assert!(parse_size("99999999999P").is_err());
        assert_eq!(parse_size("4B").unwrap(), 4);
        assert_eq!(parse_size("2KB").unwrap(), 2048);
        for bad in ["4iB", "4I", "4IB", "4BB", "", "-1", "8X", "1 K B"] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(human(1536), "1.50 KiB");
        assert_eq!(parse_volume_size("16G").unwrap(), 16 << 30);
        assert_eq!(parse_volume_size("1P").unwrap(), 1 << 50);
        for bad in ["0", "1000", "4097", "x", "2P", "1025T"] {
            assert!(parse_volume_size(bad).is_err(), "{bad:?} accepted");
        }
    }
}
