//! The page and API under load (docs/PERFORMANCE.md): `handoffs serve` over a database with
//! 10,000 deliveries while its engine works, hit from loopback by `wrk` (Debian: `apt-get
//! install wrk`).
//! Run: `cargo build --release && cargo bench --bench web`.

mod common;

use handoffs::service::Service;
use handoffs::store::Store;
use serde_json::json;
use std::process::Command;
use std::time::Instant;

fn main() {
    assert!(
        Command::new("wrk").arg("--version").output().is_ok(),
        "wrk is needed: apt-get install wrk"
    );
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.sqlite3");
    let (store, _) = Store::init(&db).unwrap();
    let mut svc = Service::new(store);
    // Ten recipients whose turns last an hour: one delivery each is running, the rest wait.
    let settings = vec![("turn_seconds".to_owned(), json!(3600))];
    svc.add_agent("boss", Some("demo"), None, None, None, &[])
        .unwrap();
    for i in 0..10 {
        svc.add_agent(&format!("a{i}"), Some("demo"), None, None, None, &settings)
            .unwrap();
    }
    let t = Instant::now();
    for i in 0..10_000 {
        let to = format!("a{}", i % 10);
        let title = (i % 3 == 0).then(|| format!("task {i}"));
        svc.send(
            "boss",
            &to,
            &format!("handoff {i}: please look at this"),
            title.as_deref(),
            None,
            None,
        )
        .unwrap();
    }
    println!(
        "seeded 10,000 deliveries in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // What one snapshot costs the server (rebuilt when the database changes, at most ten times
    // a second, never per request).
    let mut ms: Vec<f64> = (0..20)
        .map(|_| {
            let t = Instant::now();
            handoffs::front::web::build(&mut svc, &handoffs::front::web::WebOptions::default())
                .unwrap();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    println!(
        "status snapshot with 10,000 deliveries: median {:.1} ms",
        ms[10]
    );
    drop(svc);
    let (mut serve, url) = common::serve(&db, dir.path());
    // Let the engine take its first pass over the backlog.
    std::thread::sleep(std::time::Duration::from_secs(3));
    for (path, connections) in [
        ("api/status", 8),
        ("api/status", 64),
        ("", 8),
        ("metrics", 8),
    ] {
        let out = Command::new("wrk")
            .args(["-t2", &format!("-c{connections}"), "-d10s", "--latency"])
            .arg(format!("{url}/{path}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let rps = text
            .lines()
            .find(|l| l.starts_with("Requests/sec"))
            .unwrap_or("Requests/sec: ?");
        let p50 = text
            .lines()
            .find(|l| l.trim_start().starts_with("50%"))
            .unwrap_or("50% ?");
        let p99 = text
            .lines()
            .find(|l| l.trim_start().starts_with("99%"))
            .unwrap_or("99% ?");
        let non2xx = text
            .lines()
            .find(|l| l.contains("Non-2xx"))
            .unwrap_or("all 2xx");
        println!(
            "GET /{path:<11} {connections:>3} connections: {}  p50 {}  p99 {}  ({})",
            rps.trim(),
            p50.trim().trim_start_matches("50%").trim(),
            p99.trim().trim_start_matches("99%").trim(),
            non2xx.trim()
        );
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(serve.id()).unwrap()),
        nix::sys::signal::Signal::SIGINT,
    );
    let _ = serve.wait();
}
