//! Identifiers and time as plain data. The core never makes an id or reads a clock: the
//! caller hands both in, so every run of `step` is a pure function of its inputs.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub String);

        impl $name {
            pub fn new(value: impl Into<String>) -> Self {
                Self(value.into())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// A message's id; a delivery is identified by its message's id.
    MessageId
);
string_id!(
    /// One sending attempt series; a resend gets a fresh one.
    RequestId
);
string_id!(
    /// A turn in the recipient's session, as the recipient's app names it.
    TurnId
);
string_id!(
    /// A registered agent's id (`[A-Za-z0-9._-]{1,64}`).
    AgentId
);

/// An instant: milliseconds since the Unix epoch, as the caller's clock saw it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Millis(pub u64);

impl Millis {
    /// Milliseconds from `earlier` to `self`; zero when the clock went backwards.
    pub fn since(self, earlier: Millis) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// The instant `ms` milliseconds later (saturating).
    #[must_use]
    pub fn plus_ms(self, ms: u64) -> Millis {
        Millis(self.0.saturating_add(ms))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}
