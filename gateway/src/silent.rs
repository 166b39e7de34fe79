//! The gateway's own code in a kernel: a request in a session of the gateway's, whose
//! messages reach no client, waited for up to a timeout. Code goes as a silent
//! `execute_request` (no execution count, no history, no stdin): a warm kernel's
//! environment, hibernation's save and load.
//!
//! A leaf: the session is the small [`Session`] trait, so the relay and the kernel table
//! both reach this module while it reaches neither.

use kernelgate_protocol::content::ExecuteRequest;
use kernelgate_protocol::execution::Outcome;
use kernelgate_protocol::{Channel, Execution, Message, RawJson};
use std::future::Future;
use std::time::Duration;

/// A session of the gateway's own on one kernel.
pub trait Session: Sync {
    /// A request of the gateway's, in the kernel's gateway session.
    fn request(&self, msg_type: &str, content: RawJson) -> Message;

    /// Sends a request to the kernel; the error says why it could not go.
    fn send(
        &self,
        channel: Channel,
        message: Message,
    ) -> impl Future<Output = Result<(), String>> + Send;

    /// Waits for the next messages for the session and hands each to `each`; false once
    /// the session is gone.
    fn next(
        &self,
        each: &mut (dyn FnMut(Channel, &Message) + Send),
    ) -> impl Future<Output = bool> + Send;
}

/// Why a request has no answer.
pub enum Unanswered<'a, S> {
    /// It could not be sent.
    NotSent(String),
    /// The kernel (or the session) went away before it answered.
    Gone,
    /// None came within the timeout; [`Pending::wait`] waits on.
    TimedOut(Box<Pending<'a, S>>),
}

/// A request sent and not answered yet.
pub struct Pending<'a, S> {
    session: &'a S,
    execution: Execution,
    outcome: Outcome,
}

impl<S> std::fmt::Debug for Unanswered<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unanswered::NotSent(why) => f.debug_tuple("NotSent").field(why).finish(),
            Unanswered::Gone => f.write_str("Gone"),
            Unanswered::TimedOut(pending) => f.debug_tuple("TimedOut").field(pending).finish(),
        }
    }
}

impl<S> std::fmt::Debug for Pending<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("execution", &self.execution)
            .field("outcome", &self.outcome)
            .finish_non_exhaustive()
    }
}

/// Runs `code` silently in the kernel behind `session` and waits up to `timeout` for it
/// to finish: what it printed and showed, and its reply (see [`raised`]).
pub async fn execute<'a, S: Session>(
    session: &'a S,
    code: &str,
    timeout: Duration,
) -> Result<Outcome, Unanswered<'a, S>> {
    let mut request = ExecuteRequest::new(code);
    request.silent = true;
    request.store_history = false;
    request.allow_stdin = false;
    let message = session.request("execute_request", RawJson::from_value(&request));
    let pending = send(session, message).await?;
    pending.wait(timeout).await
}

/// Sends one request of the gateway's on shell; its answer is waited for with
/// [`Pending::wait`].
pub async fn send<S: Session>(
    session: &S,
    message: Message,
) -> Result<Pending<'_, S>, Unanswered<'_, S>> {
    let execution = Execution::new(message.msg_id());
    session
        .send(Channel::Shell, message)
        .await
        .map_err(Unanswered::NotSent)?;
    Ok(Pending {
        session,
        execution,
        outcome: Outcome::default(),
    })
}

impl<'a, S: Session> Pending<'a, S> {
    /// Waits up to `timeout` more for the reply and the `idle` that ends the request.
    pub async fn wait(mut self, timeout: Duration) -> Result<Outcome, Unanswered<'a, S>> {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.execution.is_done() {
            let (execution, outcome) = (&mut self.execution, &mut self.outcome);
            let mut each = |channel: Channel, message: &Message| {
                if let Some(event) = execution.feed(channel, message) {
                    outcome.apply(&event);
                }
            };
            let received = tokio::time::timeout_at(deadline, self.session.next(&mut each)).await;
            match received {
                Err(_) => return Err(Unanswered::TimedOut(Box::new(self))),
                Ok(false) => return Err(Unanswered::Gone),
                Ok(true) => {}
            }
        }
        match self.execution.reply() {
            Some(_) => Ok(self.outcome),
            None => Err(Unanswered::Gone),
        }
    }
}

/// The error's name and value when the code raised.
pub fn raised(outcome: &Outcome) -> Option<(String, String)> {
    match &outcome.reply {
        Some(r) if r.status != "ok" => Some((r.ename.clone(), r.evalue.clone())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelgate_protocol::Header;
    use serde_json::{json, Value};
    use std::sync::Mutex;
    use tokio::sync::mpsc;

    type Batch = Option<Vec<(Channel, Message)>>;
    /// Messages of the kernel, as their channel, type and content.
    type Script = Vec<(Channel, &'static str, Value)>;

    /// A kernel that answers the next request with the batches scripted for it (`None`:
    /// the session ends), and keeps what it was sent.
    struct Kernel {
        script: Mutex<Vec<Option<Script>>>,
        sent: Mutex<Vec<Message>>,
        tx: mpsc::UnboundedSender<Batch>,
        rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Batch>>,
    }

    impl Kernel {
        fn new(script: Vec<Option<Script>>) -> Self {
            let (tx, rx) = mpsc::unbounded_channel();
            Kernel {
                script: Mutex::new(script),
                sent: Mutex::default(),
                tx,
                rx: tokio::sync::Mutex::new(rx),
            }
        }

        /// Answers the first request sent with `batch`.
        fn answer(&self, batch: &[(Channel, &str, Value)]) {
            let parent = self.sent.lock().expect("sent")[0].header.clone();
            let batch = batch
                .iter()
                .map(|(channel, msg_type, content)| {
                    let header = Header::new(msg_type, "k", "kernel", "2026-01-01T00:00:00Z");
                    let content = RawJson::from_value(content);
                    (
                        *channel,
                        Message::new(header, Some(parent.clone()), content),
                    )
                })
                .collect();
            self.tx.send(Some(batch)).expect("open");
        }
    }

    impl Session for Kernel {
        fn request(&self, msg_type: &str, content: RawJson) -> Message {
            let header = Header::new(msg_type, "gw", "kernelgate", "2026-01-01T00:00:00Z");
            Message::new(header, None, content)
        }

        async fn send(&self, _: Channel, message: Message) -> Result<(), String> {
            self.sent.lock().expect("sent").push(message);
            let script: Vec<_> = self.script.lock().expect("script").drain(..).collect();
            for batch in script {
                match batch {
                    Some(batch) => self.answer(&batch),
                    None => self.tx.send(None).expect("open"),
                }
            }
            Ok(())
        }

        async fn next(&self, each: &mut (dyn FnMut(Channel, &Message) + Send)) -> bool {
            match self.rx.lock().await.recv().await {
                Some(Some(batch)) => {
                    for (channel, message) in &batch {
                        each(*channel, message);
                    }
                    true
                }
                _ => false,
            }
        }
    }

    fn busy() -> (Channel, &'static str, Value) {
        (Channel::IoPub, "status", json!({"execution_state": "busy"}))
    }

    fn idle() -> (Channel, &'static str, Value) {
        (Channel::IoPub, "status", json!({"execution_state": "idle"}))
    }

    fn reply(content: Value) -> (Channel, &'static str, Value) {
        (Channel::Shell, "execute_reply", content)
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn code_runs_silently_and_its_outputs_come_back() {
        let kernel = Kernel::new(vec![Some(vec![
            busy(),
            (
                Channel::IoPub,
                "stream",
                json!({"name": "stdout", "text": "hi\n"}),
            ),
            reply(json!({"status": "ok", "execution_count": 0})),
            idle(),
        ])]);
        let answer = execute(&kernel, "print('hi')", SECOND)
            .await
            .expect("answered");
        assert_eq!(answer.stdout, "hi\n");
        assert_eq!(raised(&answer), None);
        let sent = kernel.sent.lock().expect("sent");
        let content: Value = sent[0].content.parse().expect("json");
        assert_eq!(sent[0].msg_type(), "execute_request");
        assert_eq!(content["code"], "print('hi')");
        assert_eq!(
            (
                &content["silent"],
                &content["store_history"],
                &content["allow_stdin"]
            ),
            (&json!(true), &json!(false), &json!(false))
        );
    }

    #[tokio::test]
    async fn an_error_is_named() {
        let kernel = Kernel::new(vec![Some(vec![
            busy(),
            reply(json!({"status": "error", "ename": "HibernateBlocked", "evalue": "a socket"})),
            idle(),
        ])]);
        let answer = execute(&kernel, "save()", SECOND).await.expect("answered");
        assert_eq!(
            raised(&answer),
            Some(("HibernateBlocked".to_owned(), "a socket".to_owned()))
        );
    }

    #[tokio::test]
    async fn past_the_timeout_the_caller_may_wait_on() {
        let kernel = Kernel::new(vec![Some(vec![busy()])]);
        let pending = match execute(&kernel, "slow()", Duration::from_millis(50)).await {
            Err(Unanswered::TimedOut(pending)) => pending,
            other => panic!("not timed out: {other:?}"),
        };
        kernel.answer(&[reply(json!({"status": "ok"})), idle()]);
        let answer = pending.wait(SECOND).await.expect("answered after all");
        assert_eq!(raised(&answer), None);
    }

    #[tokio::test]
    async fn a_session_that_ends_has_no_answer() {
        let kernel = Kernel::new(vec![Some(vec![busy()]), None]);
        let result = execute(&kernel, "1", SECOND).await;
        assert!(matches!(result, Err(Unanswered::Gone)), "{result:?}");
    }
}
