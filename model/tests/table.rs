//! The (state × event) table and the state diagram are rendered from `step`; the snapshot and
//! the checked-in diagram fail this test the moment the code and the documents disagree.

use model::table::{render_dot, render_table, sample_records, transitions};
use model::{Delivery, MessageKind, Policy, StateKind};
use std::path::Path;

#[test]
fn every_state_and_event_pair_matches_the_table_snapshot() {
    insta::assert_snapshot!("delivery_table", render_table(&Policy::default()));
}

#[test]
fn the_state_diagram_in_docs_is_generated_from_step() {
    let dot = render_dot(&Policy::default());
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/delivery-states.dot");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != dot {
        std::fs::write(&path, &dot).expect("write docs/delivery-states.dot");
        panic!("docs/delivery-states.dot was out of date and has been regenerated: commit it");
    }
}

#[test]
fn every_sample_state_is_covered_and_every_record_round_trips_through_json() {
    let samples = sample_records();
    for kind in StateKind::ALL {
        assert!(
            samples.iter().any(|(_, d)| d.kind() == kind),
            "no sample record in state {kind}"
        );
    }
    for (label, record) in samples {
        let json = serde_json::to_string(&record).expect("serialize");
        let back: Delivery = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, record, "{label} did not round-trip: {json}");
        assert!(json.contains(&format!("\"state\":\"{}\"", record.kind())));
    }
}

/// Each transition SPEC §2 describes, as (from, to, event).
const SPEC_TRANSITIONS: &[(StateKind, StateKind, &str)] = {
    use StateKind::*;
    &[
        // §2.2 step 1–6 from every pending state (shown from WAITING and the holds).
        (Waiting, Failed, "pass_started"),
        (Waiting, Acknowledged, "pass_started"),
        (Waiting, Held, "pass_started"),
        (Waiting, Unavailable, "pass_started"),
        (Busy, Held, "pass_started"),
        (Held, Waiting, "pass_started"),
        (Unavailable, Waiting, "pass_started"),
        (OwnerRejected, Held, "pass_started"),
        // step 7
        (Waiting, Busy, "activity_observed"),
        (Waiting, Unavailable, "activity_observed"),
        // step 8
        (Waiting, Sending, "reservation"),
        (Busy, Sending, "reservation"),
        (OwnerRejected, Sending, "reservation"),
        (Waiting, Busy, "reservation"),
        // step 9
        (Sending, Held, "send_boundary"),
        (Sending, Busy, "send_boundary"),
        (Sending, Unavailable, "send_boundary"),
        // step 10
        (Sending, Accepted, "write_result"),
        (Sending, OwnerRejected, "write_result"),
        (Sending, Failed, "write_result"),
        (Sending, Uncertain, "write_result"),
        // §2.3 observation and timeouts
        (Accepted, Running, "observation"),
        (Accepted, Returned, "observation"),
        (Accepted, Failed, "observation"),
        (Running, Returned, "observation"),
        (Running, Failed, "observation"),
        (Uncertain, Accepted, "observation"),
        (Uncertain, Running, "observation"),
        (Uncertain, Returned, "observation"),
        (Uncertain, Failed, "observation"),
        (Sending, Uncertain, "time_passed"),
        (Accepted, Uncertain, "time_passed"),
        (Running, Uncertain, "time_passed"),
        // §2.3 bounded resend
        (Failed, Waiting, "pass_started"),
        // §2.4 honest release
        (Uncertain, Returned, "history_scan"),
        (Uncertain, Cancelled, "history_scan"),
        (Waiting, Cancelled, "release"),
        (Sending, Cancelled, "release"),
        (Uncertain, Cancelled, "release"),
        (Accepted, Cancelled, "release"),
        (Running, Cancelled, "release"),
    ]
};

#[test]
fn no_transition_of_spec_section_2_is_missing_from_the_table() {
    let edges = transitions(&Policy::default());
    for edge in SPEC_TRANSITIONS {
        assert!(edges.contains(edge), "the table lacks {edge:?}");
    }
}

#[test]
fn nothing_leaves_a_settled_state_and_nothing_resends_from_uncertain_or_cancelled() {
    for (from, to, event) in transitions(&Policy::default()) {
        assert!(
            !matches!(
                from,
                StateKind::Returned
                    | StateKind::Acknowledged
                    | StateKind::Cancelled
                    | StateKind::Duplicate
            ),
            "{from} -> {to} on {event}"
        );
        if to == StateKind::Waiting {
            assert!(
                !matches!(from, StateKind::Uncertain | StateKind::Cancelled),
                "{from} -> WAITING on {event} would be a resend (G4)"
            );
        }
    }
}

#[test]
fn enrolment_deduplicates_plain_handoffs_only() {
    let core = |kind| {
        model::Core::enrol(
            model::MessageId::new("m1"),
            model::Target {
                agent: model::AgentId::new("a"),
                provider: model::Provider::Command,
                endpoint: String::new(),
                cwd: String::new(),
                route: std::collections::BTreeMap::new(),
            },
            kind,
            "h".to_owned(),
            model::RequestId::new("r1"),
            model::Millis(0),
        )
    };
    let of = Some(model::MessageId::new("m0"));
    let plain = core(MessageKind::Plain);
    assert_eq!(
        model::enrol(plain.clone(), of.clone()).kind(),
        StateKind::Duplicate
    );
    assert_eq!(model::enrol(plain, None).kind(), StateKind::Waiting);
    assert_eq!(
        model::enrol(core(MessageKind::Work), of).kind(),
        StateKind::Waiting
    );
}
