//! Chains (SPEC §8.2), free of IO: a budget spent all or nothing, the rule that places a
//! continuation under its chain's hop budget and depth limit, a spend from inside a turn, a
//! person's resume, and what a cancel does to each delivery of the chain and to any write
//! still to come. The service stores chains and decides by these functions; the model
//! checker explores them (`model/tests/chains.rs`). The task ledger's handoff budget (SPEC
//! §8.1) is a [`Budget`] of one unit, spent by the same [`Budget::spend`].

use crate::delivery::Delivery;
use crate::policy::{PlantedBug, Policy};
use std::collections::BTreeMap;
use std::fmt;

/// The unit a chain's continuations spend, one per hop.
pub const HOPS: &str = "hops";

/// An amount of a budget's unit, kept in millionths so that `usd=0.37` adds up exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Amount(i64);

impl Amount {
    const SCALE: i64 = 1_000_000;
    pub const ZERO: Amount = Amount(0);
    /// The most a budget may hold of one unit: 10¹² (tokens by the trillion, dollars too).
    pub const MAX: Amount = Amount(1_000_000_000_000 * Self::SCALE);

    /// `n` whole units.
    pub fn whole(n: i64) -> Amount {
        Amount(n.saturating_mul(Self::SCALE).min(Self::MAX.0))
    }

    /// The amount as stored: millionths of a unit.
    pub fn millionths(self) -> i64 {
        self.0
    }

    pub fn from_millionths(m: i64) -> Amount {
        Amount(m)
    }

    /// The whole units in it (rounded down).
    pub fn whole_units(self) -> i64 {
        self.0 / Self::SCALE
    }

    fn plus(self, other: Amount) -> Amount {
        Amount(self.0.saturating_add(other.0))
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, frac) = (self.0 / Self::SCALE, self.0 % Self::SCALE);
        if frac == 0 {
            return write!(f, "{whole}");
        }
        let digits = format!("{frac:06}");
        write!(f, "{whole}.{}", digits.trim_end_matches('0'))
    }
}

impl std::str::FromStr for Amount {
    type Err = String;

    /// A plain decimal: `12`, `0.37`; at most six decimals, at most 10¹².
    fn from_str(s: &str) -> Result<Amount, String> {
        let bad = || format!("{s:?} is not an amount: give a number such as 200000 or 0.37");
        let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(whole) || !(frac.is_empty() || digits(frac)) || s.ends_with('.') {
            return Err(bad());
        }
        if frac.len() > 6 {
            return Err(format!("{s:?} has more than six decimals"));
        }
        let too_big = || format!("{s:?} is more than a budget may hold (10^12)");
        let whole: i64 = whole.parse().map_err(|_| too_big())?;
        let frac: i64 = format!("{frac:0<6}").parse().map_err(|_| bad())?;
        let m = whole
            .checked_mul(Self::SCALE)
            .and_then(|w| w.checked_add(frac))
            .filter(|m| *m <= Self::MAX.0)
            .ok_or_else(too_big)?;
        Ok(Amount(m))
    }
}

impl serde::Serialize for Amount {
    /// A JSON number: an integer when whole.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 % Self::SCALE == 0 {
            s.serialize_i64(self.0 / Self::SCALE)
        } else {
            #[allow(clippy::cast_precision_loss)] // for display only; the store keeps millionths
            s.serialize_f64(self.0 as f64 / Self::SCALE as f64)
        }
    }
}

/// A unit name: letters, digits, `_` and `-`, 1 to 32 characters, starting with a letter.
pub fn check_unit(unit: &str) -> Result<(), String> {
    let ok = unit.len() <= 32
        && unit.starts_with(|c: char| c.is_ascii_alphabetic())
        && unit
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{unit:?} is not a unit name: letters, digits, _ and -, starting with a letter, at most 32"
        ))
    }
}

/// Parses `UNIT=N[,UNIT=N…]` (`tokens=1200,usd=0.05`); a unit named twice is refused.
pub fn parse_amounts(text: &str) -> Result<Vec<(String, Amount)>, String> {
    let mut out: BTreeMap<String, Amount> = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (unit, n) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?}: give UNIT=N, e.g. tokens=1200"))?;
        let unit = unit.trim();
        check_unit(unit)?;
        let n: Amount = n.trim().parse()?;
        if out.insert(unit.to_owned(), n).is_some() {
            return Err(format!("{unit} is given twice: give each unit once"));
        }
    }
    if out.is_empty() {
        return Err("give at least one UNIT=N, e.g. tokens=1200".to_owned());
    }
    Ok(out.into_iter().collect())
}

/// Units given as JSON numbers (`{"tokens": 1200, "usd": 0.1}`, from MCP or HTTP) as the
/// text `parse_amounts` reads, each name checked and each number rounded to millionths (so
/// a float sum such as 0.30000000000000004 is 0.3, never "more than six decimals").
pub fn units_from_numbers<'a>(
    units: impl IntoIterator<Item = (&'a str, f64)>,
) -> Result<String, String> {
    let mut parts = Vec::new();
    for (unit, n) in units {
        check_unit(unit)?;
        if !n.is_finite() || n < 0.0 {
            return Err(format!(
                "{unit}: {n} is not an amount: give a number of 0 or more"
            ));
        }
        let m = (n * 1e6).round();
        #[allow(clippy::cast_precision_loss)] // 10^18 is exact enough to compare against
        let max = Amount::MAX.0 as f64;
        if m > max {
            return Err(format!(
                "{unit}: {n} is more than a budget may hold (10^12)"
            ));
        }
        #[allow(clippy::cast_possible_truncation)] // finite, 0 ≤ m ≤ 10^18
        parts.push(format!("{unit}={}", Amount(m as i64)));
    }
    if parts.is_empty() {
        return Err("give at least one unit, e.g. {\"tokens\": 1200}".to_owned());
    }
    Ok(parts.join(","))
}

/// One unit of a budget: its limit (none: only counted) and what was spent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Line {
    pub limit: Option<Amount>,
    pub spent: Amount,
}

/// What a budget holds, by unit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct Budget {
    pub lines: BTreeMap<String, Line>,
}

/// A spend refused: it would take `unit` past its limit. Nothing of it was spent.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Exceeded {
    pub unit: String,
    pub limit: Amount,
    pub spent: Amount,
    pub asked: Amount,
}

impl fmt::Display for Exceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "budget {}={} spent: {} used, {} more asked",
            self.unit, self.limit, self.spent, self.asked
        )
    }
}

impl Budget {
    /// A budget with these limits, nothing spent.
    pub fn limited<'a>(limits: impl IntoIterator<Item = (&'a str, Amount)>) -> Budget {
        let lines = limits
            .into_iter()
            .map(|(u, limit)| {
                (
                    u.to_owned(),
                    Line {
                        limit: Some(limit),
                        spent: Amount::ZERO,
                    },
                )
            })
            .collect();
        Budget { lines }
    }

    pub fn spent(&self, unit: &str) -> Amount {
        self.lines.get(unit).map_or(Amount::ZERO, |l| l.spent)
    }

    pub fn limit(&self, unit: &str) -> Option<Amount> {
        self.lines.get(unit).and_then(|l| l.limit)
    }

    /// Spends every amount of `ask`, or nothing: refused with the first unit the spend would
    /// take past its limit. A unit without a limit is counted.
    pub fn spend(&mut self, ask: &[(String, Amount)], policy: &Policy) -> Result<(), Exceeded> {
        let mut total: BTreeMap<&str, Amount> = BTreeMap::new();
        for (unit, n) in ask {
            let t = total.entry(unit.as_str()).or_default();
            *t = t.plus(*n);
        }
        for (unit, asked) in &total {
            let Some(line) = self.lines.get(*unit) else {
                continue;
            };
            let Some(limit) = line.limit else {
                continue;
            };
            let over = if policy.planted(PlantedBug::SpendPastBudget) {
                line.spent > limit
            } else {
                line.spent.plus(*asked) > limit
            };
            if over {
                return Err(Exceeded {
                    unit: (*unit).to_owned(),
                    limit,
                    spent: line.spent,
                    asked: *asked,
                });
            }
        }
        for (unit, asked) in total {
            let line = self.lines.entry(unit.to_owned()).or_default();
            line.spent = line.spent.plus(asked).min(Amount::MAX);
        }
        Ok(())
    }

    /// A person adds `n` to `unit`: what is left to spend afterwards is `n` more than before
    /// (a unit spent to or past its limit restarts from what was used; a unit without a limit
    /// gets one, `n` above what it used).
    pub fn add(&mut self, unit: &str, n: Amount) {
        let line = self.lines.entry(unit.to_owned()).or_default();
        let base = line.limit.map_or(line.spent, |l| l.max(line.spent));
        line.limit = Some(base.plus(n).min(Amount::MAX));
    }
}

/// Whether a chain may go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChainState {
    Open,
    /// Stopped by its budget or depth limit until a person lifts it.
    NeedsHuman,
    /// Cancelled with everything pending in it, for good.
    Cancelled,
}

impl ChainState {
    pub fn as_str(self) -> &'static str {
        match self {
            ChainState::Open => "open",
            ChainState::NeedsHuman => "needs_human",
            ChainState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for ChainState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ChainState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "open" => Ok(ChainState::Open),
            "needs_human" => Ok(ChainState::NeedsHuman),
            "cancelled" => Ok(ChainState::Cancelled),
            other => Err(format!("unknown chain state {other:?}")),
        }
    }
}

/// A chain as its rules see it: its state, its budget (hops and the caller's units) and its
/// depth limit.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Chain {
    pub state: ChainState,
    pub budget: Budget,
    pub depth_limit: i64,
}

/// Why a chain stopped.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Stop {
    /// A continuation at depth `at` is past the limit.
    Depth { limit: i64, at: i64 },
    /// A hop or a spend is past the budget.
    Budget(Exceeded),
}

impl Stop {
    /// What a person adds to lift it: `depth` or the unit.
    pub fn lifted_by(&self) -> &str {
        match self {
            Stop::Depth { .. } => "depth",
            Stop::Budget(e) => &e.unit,
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Depth { limit, at } => {
                write!(f, "depth limit {limit} reached: it would be at depth {at}")
            }
            Stop::Budget(e) if e.unit == HOPS => write!(
                f,
                "hop budget {} spent: it would be hop {}",
                e.limit,
                e.spent.plus(e.asked)
            ),
            Stop::Budget(e) => e.fmt(f),
        }
    }
}

/// What the rules decided for a continuation or a spend.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Allowed and spent.
    Go,
    /// Refused, and the chain stops now (`NeedsHuman`): its origin is told, once.
    Stops(Stop),
    /// Refused: the chain was already stopped or cancelled; nothing changes.
    Refused(ChainState),
}

impl Chain {
    /// A chain with `hops` continuations, the caller's `units` and a depth limit.
    pub fn new(hops: i64, units: &[(String, Amount)], depth_limit: i64) -> Chain {
        let mut budget = Budget::limited([(HOPS, Amount::whole(hops))]);
        for (unit, n) in units {
            budget.lines.insert(
                unit.clone(),
                Line {
                    limit: Some(*n),
                    spent: Amount::ZERO,
                },
            );
        }
        Chain {
            state: ChainState::Open,
            budget,
            depth_limit,
        }
    }

    /// A continuation at depth `depth` (its parent's plus one) spends one hop.
    pub fn continue_at(&mut self, depth: i64, policy: &Policy) -> Decision {
        if self.state != ChainState::Open {
            return Decision::Refused(self.state);
        }
        if depth > self.depth_limit {
            return self.stop(Stop::Depth {
                limit: self.depth_limit,
                at: depth,
            });
        }
        self.spend(&[(HOPS.to_owned(), Amount::whole(1))], policy)
    }

    /// A turn working in this chain spends `ask` (all or nothing).
    pub fn spend(&mut self, ask: &[(String, Amount)], policy: &Policy) -> Decision {
        if self.state != ChainState::Open {
            return Decision::Refused(self.state);
        }
        match self.budget.spend(ask, policy) {
            Ok(()) => Decision::Go,
            Err(e) => self.stop(Stop::Budget(e)),
        }
    }

    fn stop(&mut self, why: Stop) -> Decision {
        self.state = ChainState::NeedsHuman;
        Decision::Stops(why)
    }

    /// A person lifts a stopped chain, adding to units of its budget or to its depth limit
    /// (`depth`); refused (with the state) unless it is stopped.
    pub fn resume(&mut self, add: &[(String, Amount)]) -> Result<(), ChainState> {
        if self.state != ChainState::NeedsHuman {
            return Err(self.state);
        }
        for (unit, n) in add {
            if unit == "depth" {
                self.depth_limit = self.depth_limit.saturating_add(n.whole_units());
            } else {
                self.budget.add(unit, *n);
            }
        }
        self.state = ChainState::Open;
        Ok(())
    }

    /// Cancels the chain, for good: false when it already was.
    pub fn cancel(&mut self) -> bool {
        let was = self.state;
        self.state = ChainState::Cancelled;
        was != ChainState::Cancelled
    }

    /// Whether a delivery of this chain may still be written: never once it is cancelled.
    pub fn may_write(&self, policy: &Policy) -> bool {
        self.state != ChainState::Cancelled
            || policy.planted(PlantedBug::CancelLeavesPending)
            || policy.planted(PlantedBug::RequeueAfterCancel)
    }
}

/// What a chain's cancel does to one of its deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OnCancel {
    /// Pending, reserved but not written, or FAILED with a resend planned: released
    /// (CANCELLED), never written.
    Release,
    /// A turn under way, or a write that may have landed: not interrupted; its later return
    /// is recorded as late.
    Mark,
    /// Settled: nothing to do.
    Leave,
}

/// What the cancel of its chain does to `d`.
pub fn on_cancel(d: &Delivery, policy: &Policy) -> OnCancel {
    if d.is_settled() {
        return OnCancel::Leave;
    }
    let writing = matches!(d, Delivery::Sending(s) if s.write_issued())
        || policy.planted(PlantedBug::CancelMarksReserved);
    if !d.is_active() || !writing && matches!(d, Delivery::Sending(_)) {
        if policy.planted(PlantedBug::CancelLeavesPending) {
            return OnCancel::Leave;
        }
        return OnCancel::Release;
    }
    OnCancel::Mark
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(s: &str) -> Vec<(String, Amount)> {
        parse_amounts(s).unwrap()
    }

    #[test]
    fn units_from_json_numbers_are_checked_and_rounded_to_millionths() {
        assert_eq!(
            units_from_numbers([("tokens", 1200.0), ("usd", 0.1 + 0.2)]),
            Ok("tokens=1200,usd=0.3".to_owned())
        );
        for bad in [
            vec![("tokens=1,usd", 2.0)],
            vec![("tokens", -1.0)],
            vec![("tokens", f64::NAN)],
            vec![("tokens", 1e13)],
            vec![],
        ] {
            assert!(units_from_numbers(bad.clone()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn amounts_parse_print_and_add_up_exactly() {
        for (text, shown) in [
            ("12", "12"),
            ("0.37", "0.37"),
            ("5.500000", "5.5"),
            ("0", "0"),
        ] {
            assert_eq!(text.parse::<Amount>().unwrap().to_string(), shown);
        }
        for bad in [
            "",
            "-1",
            "1.",
            ".5",
            "1e3",
            "0.1234567",
            "1000000000001",
            "x",
        ] {
            assert!(bad.parse::<Amount>().is_err(), "{bad:?}");
        }
        let mut b = Budget::limited([("usd", "0.3".parse().unwrap())]);
        let p = Policy::default();
        assert!(b.spend(&units("usd=0.1"), &p).is_ok());
        assert!(b.spend(&units("usd=0.2"), &p).is_ok(), "0.1 + 0.2 is 0.3");
        let e = b.spend(&units("usd=0.000001"), &p).unwrap_err();
        assert_eq!(
            e.to_string(),
            "budget usd=0.3 spent: 0.3 used, 0.000001 more asked"
        );
    }

    #[test]
    fn a_spend_is_all_or_nothing_and_unlimited_units_are_counted() {
        let p = Policy::default();
        let mut b = Budget::limited([("tokens", Amount::whole(100))]);
        assert!(b.spend(&units("tokens=60,usd=1"), &p).is_ok());
        assert!(b.spend(&units("usd=2,tokens=41"), &p).is_err());
        assert_eq!(
            b.spent("usd"),
            Amount::whole(1),
            "nothing of a refused spend"
        );
        assert_eq!(b.spent("tokens"), Amount::whole(60));
        assert!(
            parse_amounts("tokens=20,tokens=21").is_err(),
            "a unit named twice is a mistake, never summed"
        );
        b.add("tokens", Amount::whole(10));
        assert_eq!(b.limit("tokens"), Some(Amount::whole(110)));
        b.add("usd", Amount::whole(1));
        assert_eq!(
            b.limit("usd"),
            Some(Amount::whole(2)),
            "one above what it used"
        );
    }

    #[test]
    fn a_chain_stops_once_and_takes_nothing_until_resumed() {
        let p = Policy::default();
        let mut c = Chain::new(1, &units("tokens=10"), 2);
        assert_eq!(c.continue_at(1, &p), Decision::Go);
        let Decision::Stops(why) = c.continue_at(2, &p) else {
            panic!("a second hop in a budget of one")
        };
        assert_eq!(why.to_string(), "hop budget 1 spent: it would be hop 2");
        assert_eq!(
            c.spend(&units("tokens=1"), &p),
            Decision::Refused(ChainState::NeedsHuman)
        );
        assert_eq!(c.resume(&units("hops=1")), Ok(()));
        assert_eq!(
            c.continue_at(3, &p),
            Decision::Stops(Stop::Depth { limit: 2, at: 3 })
        );
        assert!(c.resume(&units("depth=1")).is_ok());
        assert_eq!(c.continue_at(3, &p), Decision::Go);
        assert!(c.cancel());
        assert!(!c.may_write(&p));
        assert_eq!(c.resume(&units("hops=1")), Err(ChainState::Cancelled));
    }
}
