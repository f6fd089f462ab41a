//! Parsing and printing byte sizes (`16G`, `512MiB`, `4096`).

/// Parses a size in bytes: a whole number with an optional binary suffix
/// (K, M, G, T, P with optional `i`/`B`: `16G` = `16GiB` = 16 × 2^30).
/// A fraction (`1.5G`) is refused with the whole number of a smaller unit
/// to give instead (`1536M`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    parse_size_in(s, false)
}

/// [`parse_size`]; with `blocks`, a fraction's suggested replacement is a
/// whole number of 4 KiB blocks.
fn parse_size_in(s: &str, blocks: bool) -> Result<u64, String> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    if let Some(fraction) = suffix.strip_prefix(['.', ',']) {
        return Err(fractional(s, num, fraction, blocks));
    }
    let n: u64 = num.parse().map_err(|e: std::num::ParseIntError| {
        if matches!(e.kind(), std::num::IntErrorKind::PosOverflow) {
            format!("size {s:?} is too large")
        } else {
            format!("invalid size {s:?}: expected a whole number with an optional K/M/G/T/P suffix")
        }
    })?;
    let (shift, _) = unit_shift(s, suffix)?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// The binary shift of a size's suffix (`G`: 30) and its letter (`""` for
/// bytes).
fn unit_shift(s: &str, suffix: &str) -> Result<(u32, &'static str), String> {
    let unit = suffix.trim().to_ascii_uppercase();
    // bytes: no suffix or B; else K, KB or KiB (likewise M, G, T, P)
    let prefix = match unit.as_str() {
        "" | "B" => "",
        u => u
            .strip_suffix("IB")
            .or_else(|| u.strip_suffix('B'))
            .unwrap_or(u),
    };
    Ok(match prefix {
        "" if unit.len() <= 1 => (0, ""),
        "K" => (10, "K"),
        "M" => (20, "M"),
        "G" => (30, "G"),
        "T" => (40, "T"),
        "P" => (50, "P"),
        _ => return Err(format!("invalid size suffix in {s:?}: use K, M, G, T or P")),
    })
}

/// The error for a size written with a fraction (`whole`.`rest`, `rest`
/// holding the fraction's digits and the suffix): what to write instead,
/// in the largest unit that makes it a whole number (`1.5G`: `1536M`), or
/// rounded to the unit below the one given (`1.3G`: about `1331M`); with
/// `blocks`, a whole number of 4 KiB blocks (`1.3M`: about `1332K`).
fn fractional(s: &str, whole: &str, rest: &str, blocks: bool) -> String {
    const NOT_ACCEPTED: &str = "fractional sizes are not accepted";
    let digits_end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (frac, suffix) = rest.split_at(digits_end);
    let parsed = (|| {
        let (shift, _) = unit_shift(s, suffix).ok()?;
        // (bounded: beyond 18 digits the fraction is below a byte of any unit)
        let frac = &frac[..frac.len().min(18)];
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().ok()?
        };
        let scale = 10u128.pow(frac.len() as u32);
        let part: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().ok()?
        };
        // the size in units of 1/scale byte
        let exact = whole
            .checked_mul(scale)?
            .checked_add(part)?
            .checked_mul(1u128 << shift)?;
        Some((exact, scale, shift))
    })();
    let Some((exact, scale, shift)) = parsed else {
        return format!("invalid size {s:?}: {NOT_ACCEPTED}; give a whole number with an optional K/M/G/T/P suffix");
    };
    let units = [
        (50, "P"),
        (40, "T"),
        (30, "G"),
        (20, "M"),
        (10, "K"),
        (0, ""),
    ];
    let granule: u32 = if blocks { 12 } else { 0 };
    if exact % scale == 0 && (exact / scale) % (1u128 << granule) == 0 {
        let bytes = exact / scale;
        if let Some((u, letter)) = units.iter().find(|(u, _)| bytes % (1u128 << u) == 0) {
            return format!("{s:?}: {NOT_ACCEPTED}; use {}{letter}", bytes >> u);
        }
    }
    // not a whole number of bytes (or blocks), or of the unit below: round
    // in that unit (in blocks of 4K at least)
    let (u, letter) = units
        .iter()
        .find(|(u, _)| *u + 10 <= shift)
        .copied()
        .unwrap_or((0, ""));
    let (step, letter, per_step) = if u < granule {
        (granule, "K", 1u128 << (granule - 10))
    } else {
        (u, letter, 1)
    };
    let unit = scale << step;
    let rest = exact % unit;
    let mut rounded = exact / unit + u128::from(rest >= unit - rest);
    if blocks {
        rounded = rounded.max(1);
    }
    let rounded = rounded * per_step;
    format!("{s:?}: {NOT_ACCEPTED}; use a whole number, such as {rounded}{letter} (rounded)")
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
    let v = parse_size_in(s, true)?;
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

/// `bytes` as a size argument, in the largest unit that keeps it whole
/// (`200M`, `4100K`, `12345`).
pub fn exact_size(bytes: u64) -> String {
    [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")]
        .iter()
        .find(|(shift, _)| bytes != 0 && bytes.is_multiple_of(1u64 << shift))
        .map_or(bytes.to_string(), |(shift, unit)| {
            format!("{}{unit}", bytes >> shift)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_sizes_keep_the_bytes() {
        assert_eq!(exact_size(200 << 20), "200M");
        assert_eq!(exact_size(4100 << 10), "4100K");
        assert_eq!(exact_size(16 << 30), "16G");
        assert_eq!(exact_size(12345), "12345");
        assert_eq!(exact_size(0), "0");
    }

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
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_volume_size("16G").unwrap(), 16 << 30);
        assert_eq!(parse_volume_size("1P").unwrap(), 1 << 50);
        for bad in ["0", "1000", "4097", "x", "2P", "1025T"] {
            assert!(parse_volume_size(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn fractions_are_refused_with_what_to_write_instead() {
        let e = parse_volume_size("1.5G").unwrap_err();
        assert!(
            e.contains("fractional sizes are not accepted; use 1536M"),
            "{e}"
        );
        for (frac, instead) in [
            ("2.25T", "use 2304G"),
            ("0.5k", "use 512"),
            ("1.0G", "use 1G"),
            ("1.5GiB", "use 1536M"),
            ("1.3G", "such as 1331M (rounded)"),
            ("0.1K", "such as 102 (rounded)"),
            ("1.", "use 1"),
        ] {
            let e = parse_size(frac).unwrap_err();
            assert!(e.contains("fractional sizes are not accepted"), "{e}");
            assert!(e.contains(instead), "{frac}: {e}");
        }
        let e = parse_size("1.5X").unwrap_err();
        assert!(e.contains("fractional sizes are not accepted"), "{e}");
        // a volume's size is suggested in whole 4K blocks
        for (frac, instead) in [
            ("1.3M", "such as 1332K (rounded)"),
            ("4.5K", "such as 4K (rounded)"),
            ("0.5K", "such as 4K (rounded)"),
            ("1.5M", "use 1536K"),
            ("1.5G", "use 1536M"),
        ] {
            let e = parse_volume_size(frac).unwrap_err();
            assert!(e.contains(instead), "{frac}: {e}");
        }
        // huge values: said to be too large, no overflow in the hint
        let e = parse_size("99999999999999999999G").unwrap_err();
        assert!(e.contains("too large"), "{e}");
        let e = parse_size("302231.454903657293676543P").unwrap_err();
        assert!(e.contains("fractional sizes are not accepted"), "{e}");
    }
}
