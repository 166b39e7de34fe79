//! Times as Jupyter writes them (message headers, kernel models' `last_activity`), and as
//! the audit trail and the approvals list show them: ISO 8601, UTC, microseconds, `Z`.
//! JupyterLab's culler parses `last_activity` and needs the fraction and the `Z`.

use chrono::{DateTime, Utc};

/// Now, as Jupyter writes it.
pub fn now_iso() -> String {
    iso(Utc::now())
}

/// `t` as Jupyter writes it: `2026-08-01T12:34:56.789012Z`.
pub fn iso(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn microseconds_and_z() {
        let t = Utc
            .with_ymd_and_hms(2026, 8, 1, 12, 34, 56)
            .single()
            .expect("a valid time")
            + chrono::Duration::microseconds(789_012);
        assert_eq!(iso(t), "2026-08-01T12:34:56.789012Z");
    }
}
